"""What every benchmark shares: tables for people, the result as an object for the Python API,
and, as a command, that result as the last line of output (one line of JSON).

Each benchmark module has `run(argv) -> dict`: it parses its options, measures, prints its tables
(its `print_report`: title and summary lines around `print_table`) and returns the result, or
raises `BenchStopped`. Its `main(argv)` is `run_as_command`, which prints the result with
`print_json`, so a machine reading the output takes its last line, and `longhorizon.bench` calls
`run` and gets the object itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from longhorizon.common.args import parse_args


class BenchStopped(Exception):
    """A benchmark that ended without a result: after `--help` (exit code 0) or a usage error
    argparse has printed (2), or a measurement that could not be made (1; `message` says why)."""

    def __init__(self, exit_code: int, message: str = "") -> None:
        super().__init__(message or f"exit code {exit_code}")
        self.exit_code = exit_code
        self.message = message


def parsed(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
           check: Callable[[argparse.Namespace], Any] | None = None) -> argparse.Namespace:
    """The benchmark's options (`common.args.parse_args`), or BenchStopped with its exit code."""
    args = parse_args(parser, argv, check=check)
    if isinstance(args, int):
        raise BenchStopped(args)
    return args


def run_as_command(prog: str, run: Callable[[list[str]], Any], argv: Sequence[str], *,
                   exit_code: Callable[[Any], int] = lambda result: 0) -> int:
    """A benchmark's `main`: run it, then print its result as the last line, one line of JSON, and
    return `exit_code(result)`. A stop is its exit code, its message (if any) on stderr after `prog`."""
    try:
        result = run(list(argv))
    except BenchStopped as stop:
        if stop.message:
            print(f"{prog}: {stop.message}", file=sys.stderr)
        return stop.exit_code
    print_json(result)
    return exit_code(result)


@dataclass(frozen=True)
class Column:
    """One column of a table: its title, its width in characters, and how its values are written."""

    title: str
    width: int
    format: str = ""
    """Format spec of the values (".2f", ",", "d", ...); "" writes a value as str() does."""
    left: bool = False
    """Left-aligned, for a column of row labels; the others are right-aligned, as numbers read best."""

    def cell(self, text: str) -> str:
        # Like an f-string's alignment, a cell wider than its column is written whole.
        return text.ljust(self.width) if self.left else text.rjust(self.width)


def print_table(columns: Sequence[Column], rows: Iterable[Sequence[Any]], *, separator: str = " ",
                indent: str = "") -> None:
    """A header line of the columns' titles, then one line per row of values."""
    print(indent + separator.join(column.cell(column.title) for column in columns))
    for row in rows:
        cells = (column.cell(format(value, column.format)) for column, value in zip(columns, row, strict=True))
        print(indent + separator.join(cells))


def print_json(result: Any) -> None:
    """The result as one line of JSON (keys sorted): the last line of every benchmark's output."""
    print(json.dumps(result, sort_keys=True))


def load_average() -> list[float]:
    """The machine's 1, 5 and 15-minute load averages ([] where /proc/loadavg cannot be read):
    printed beside figures measured on a shared machine."""
    try:
        with open("/proc/loadavg") as loadavg:
            return [float(value) for value in loadavg.read().split()[:3]]
    except OSError:
        return []
