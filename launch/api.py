"""The Python API: train, evaluate, report and benchmark from a script or a notebook, with the
results as objects rather than exit codes and printed tables.

    import longhorizon as lh

    run = lh.train("codebook", ["run.total_steps=20", "run.output_dir='/tmp/runs'"])
    run.records[-1]["success_rate"], run.findings, run.latest_checkpoint
    scores = lh.evaluate("codebook", checkpoint=run.latest_checkpoint, tasks=20)
    scores["success_rate"]

Each function does what the command of the same name does (`longhorizon train`, `eval`,
`report`, `bench`), with the same configs: a bundled config's name, a TOML file, or a `Config`
built in Python (`lh.load_config(...)`, then `config.replace(...)`). A run that fails raises
`RunFailed`, a wrong config `ConfigError`, as the commands print them.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from longhorizon.common.config import Config, ConfigError, load_config

ConfigLike = Config | str | Path


class RunFailed(RuntimeError):
    """A training run or command that ended with a non-zero exit code; `exit_code` holds it."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class TrainResult:
    """What a training run left: its folder, every step's metrics record, and the report's
    figures and findings (`longhorizon report`)."""

    run_dir: Path
    records: list[dict] = field(repr=False)
    summary: dict = field(repr=False)
    findings: list[str]

    @property
    def latest_checkpoint(self) -> Path | None:
        from longhorizon.learner.checkpoint import latest_checkpoint

        return latest_checkpoint(self.run_dir)


def _config(config: ConfigLike, overrides: Sequence[str]) -> Config:
    if isinstance(config, Config):
        if overrides:
            raise ConfigError("overrides go with a config's name or file; change a Config with config.replace(...)")
        return config
    return load_config(config, list(overrides))


def train(config: ConfigLike, overrides: Sequence[str] = (), *,
          progress: Callable[[str], None] = print) -> TrainResult:
    """Train as `longhorizon train` does (its launcher, processes and run folder) and return the
    run's records; `progress` receives each line the command would print."""
    from longhorizon.common.metrics import read_metrics
    from longhorizon.launch.launcher import last_error, launch
    from longhorizon.launch.report import diagnose, summarise_run

    resolved = _config(config, overrides)
    code = launch(resolved, progress=progress)
    run_dir = resolved.run_dir
    if code != 0:
        cause = last_error(run_dir / "logs" / "learner.log")
        raise RunFailed(f"training ended with exit code {code}{f': {cause}' if cause else ''} "
                        f"(logs in {run_dir / 'logs'})", code)
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    summary = summarise_run(records) if records else {}
    return TrainResult(run_dir, records, summary, diagnose(summary) if records else [])


def evaluate(config: ConfigLike, overrides: Sequence[str] = (), *, checkpoint: str | Path | None = None,
             tasks: int = 100, samples: int = 1, k: Sequence[int] = (1,), horizon: int = 0,
             sweep: str | None = None, values: Sequence[int] = (), output_dir: str | Path | None = None,
             engine_options: dict[str, Any] | None = None) -> dict:
    """Evaluate as `longhorizon eval` does and return its JSON document (success rate with its
    interval, Pass@k, per category; a sweep's points under "points")."""
    from longhorizon.launch.eval import EvalRequest, evaluate_config, write_outputs

    request = EvalRequest(checkpoint=checkpoint, tasks=tasks, samples=samples, ks=tuple(k), horizon=horizon,
                          sweep=sweep, values=tuple(values), engine_options=dict(engine_options or {}))
    document = evaluate_config(_config(config, overrides), request)
    if output_dir is not None:
        write_outputs(document, Path(output_dir))
    document.pop("_records", None)
    return document


def report(run_dir: str | Path) -> dict:
    """A run's figures (`summary`) and findings, as `longhorizon report` prints them."""
    from longhorizon.launch.report import diagnose, load_summary

    summary = load_summary(Path(run_dir))
    return {"summary": summary, "findings": diagnose(summary)}


class _Tee(io.TextIOBase):
    """Writes to the user's stdout and keeps a copy (the benchmark's last line is its JSON)."""

    def __init__(self, through: Any) -> None:
        self.through = through
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        self.through.write(text)
        return self.kept.write(text)

    def flush(self) -> None:
        self.through.flush()


def bench(name: str, *arguments: str) -> dict:
    """Run `longhorizon bench NAME ARGUMENTS...`, showing its table, and return its JSON result."""
    from longhorizon.launch.bench.cli import main

    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        code = main([name, *arguments])
    if code != 0:
        raise RunFailed(f"longhorizon bench {name} ended with exit code {code}", code)
    lines = [line for line in tee.kept.getvalue().splitlines() if line.strip()]
    return json.loads(lines[-1])
