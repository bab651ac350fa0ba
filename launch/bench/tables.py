"""What every benchmark prints: tables for people, then, last, the whole result as one line of JSON.

A benchmark's report writes its own title and summary lines around `print_table`, and ends with
`print_json(result)`, so a machine reading the output takes its last line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


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
