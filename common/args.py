"""Argument parsing for commands whose `main(argv)` returns an exit status instead of exiting.

`longhorizon bench ...`, `eval` and the other pass-through commands parse their own arguments, and
tests call their `main` directly. argparse ends the process (SystemExit) after `--help` or a usage
error; `parse_args` turns that into the status for `main` to return, and reports a value the
command refuses (a `check` that raises ValueError) the way argparse reports its own errors.
`positive_int` is the argument type of the counts they take; `key_value_options` reads repeated
KEY=VALUE flags such as `--engine-option`.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

USAGE_ERROR = 2
"""argparse's exit status for a usage error."""


def parse_args(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    check: Callable[[argparse.Namespace], Any] | None = None,
) -> argparse.Namespace | int:
    """The parsed arguments, or the exit status when the command should stop here.

    0 after `--help`; 2 after a usage error, which argparse has printed; 2 when `check(args)`
    raises ValueError, printed as `usage: ...` then `PROG: error: MESSAGE` on stderr. Callers:
    `args = parse_args(parser, argv); if isinstance(args, int): return args`.
    """
    try:
        args, extras = parser.parse_known_args(argv)
        take_late_overrides(parser, args, extras)
    except SystemExit as exit_request:
        return int(exit_request.code or 0)
    if check is not None:
        try:
            check(args)
        except ValueError as error:
            parser.print_usage(sys.stderr)
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
            return USAGE_ERROR
    return args


_OVERRIDE = re.compile(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*=")


def take_late_overrides(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: Sequence[str]) -> None:
    """Add `section.key=value` words given after options to `args.overrides`, in command-line order.

    argparse hands a positional list only the words before the first option, so
    `eval CONFIG --tasks 20 run.seed=3` would leave `run.seed=3` unrecognised. Any other
    left-over word is a usage error, as with `parse_args`.
    """
    takes_overrides = isinstance(getattr(args, "overrides", None), list)
    stray = [word for word in extras if not (takes_overrides and _OVERRIDE.match(word))]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extras:
        args.overrides = [*args.overrides, *extras]


def positive_int(text: str) -> int:
    """An argparse `type` for counts that must be at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def key_value_options(pairs: Sequence[str], flag: str = "--engine-option") -> dict[str, Any]:
    """KEY=VALUE strings, with VALUE read as TOML where it parses (numbers, booleans, tables)."""
    import tomllib

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {pair!r} is not of the form KEY=VALUE")
        try:
            options[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            options[key.strip()] = value.strip()  # a bare string such as a URL
    return options
