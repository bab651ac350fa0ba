"""The parse-args helper of commands whose main(argv) returns an exit status (common/args.py)."""

import argparse

import pytest

from longhorizon.common.args import parse_args, positive_int


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longhorizon demo")
    parser.add_argument("--count", type=int, default=1)
    return parser


def _positive(args: argparse.Namespace) -> None:
    if args.count < 1:
        raise ValueError(f"--count must be at least 1, got {args.count}")


def test_arguments_that_parse_and_pass_the_check_come_back_parsed():
    args = parse_args(_parser(), ["--count", "3"], check=_positive)
    assert isinstance(args, argparse.Namespace) and args.count == 3


def test_help_and_usage_errors_become_exit_statuses(capsys):
    assert parse_args(_parser(), ["--help"]) == 0
    assert "usage: longhorizon demo" in capsys.readouterr().out
    assert parse_args(_parser(), ["--count", "many"]) == 2
    assert "longhorizon demo: error: argument --count: invalid int value" in capsys.readouterr().err


def test_a_refused_value_is_reported_as_argparse_reports_its_own(capsys):
    assert parse_args(_parser(), ["--count", "0"], check=_positive) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: longhorizon demo")
    assert err.endswith("longhorizon demo: error: --count must be at least 1, got 0\n")


def test_positive_int_takes_counts_from_one():
    assert positive_int("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1, got 0"):
        positive_int("0")
    with pytest.raises(argparse.ArgumentTypeError, match="invalid int value: 'x'"):
        positive_int("x")
