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


def _parser_with_overrides() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longhorizon demo")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--tasks", type=int, default=0)
    return parser


def test_overrides_after_options_join_those_before_them_in_order():
    args = parse_args(_parser_with_overrides(), ["c.toml", "run.seed=1", "--tasks", "20", "run.seed=3", "env.x=a=b"])
    assert args.overrides == ["run.seed=1", "run.seed=3", "env.x=a=b"] and args.tasks == 20


def test_a_word_after_options_that_is_no_override_is_a_usage_error(capsys):
    assert parse_args(_parser_with_overrides(), ["c.toml", "--tasks", "2", "seed"]) == 2
    assert "error: unrecognized arguments: seed" in capsys.readouterr().err
    # A command without overrides takes none after its options either.
    assert parse_args(_parser(), ["--count", "2", "run.seed=3"]) == 2
    assert "error: unrecognized arguments: run.seed=3" in capsys.readouterr().err


def test_the_cli_takes_overrides_after_options_in_every_command_that_has_them(tmp_path, capsys):
    from longhorizon.launch.cli import main

    # A wrong key in a late override reaches the config check: it was taken as an override.
    config = tmp_path / "c.toml"
    config.write_text('[env]\nname = "codebook"\n')
    assert main(["train", str(config), "--no-plots", "run.no_such_key=3"]) == 2
    assert "run.no_such_key" in capsys.readouterr().err
    assert main(["collect", str(config), "--output", str(tmp_path / "x.jsonl"), "run.no_such_key=3"]) == 2
    assert "run.no_such_key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", str(config), "--no-plots", "stray"])
    assert "unrecognized arguments: stray" in capsys.readouterr().err
