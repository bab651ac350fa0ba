"""The Python API: train, evaluate, report and benchmark from a script or a notebook, with the
results as objects rather than exit codes and printed tables.

    import longhorizon as lh

    run = lh.train("codebook", ["run.total_steps=20", "run.output_dir='/tmp/runs'"])
    run.records[-1]["success_rate"], run.findings, run.latest_checkpoint
    scores = lh.evaluate("codebook", checkpoint=run.latest_checkpoint, tasks=20)
    scores["success_rate"]

Each function does what the command of the same name does (`longhorizon train`, `eval`,
`collect`, `sft`, `dpo`, `rft`, `report`, `bench`), with the same configs: a bundled config's
name, a TOML file, or a `Config` built in Python (`lh.load_config(...)`, then
`config.replace(...)`). A run that fails raises `RunFailed`, a wrong config `ConfigError`, as the
commands print them. The commands are this module's callers: they parse arguments, call a
function here and print what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longhorizon.common.config import Config, ConfigError, load_config

if TYPE_CHECKING:
    from longhorizon.actor.collect import CollectSummary

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
          progress: Callable[[str], None] = print, in_process: bool = False) -> TrainResult:
    """Train as `longhorizon train` does (its launcher, processes and run folder) and return the
    run's records; `progress` receives each line the command would print. `in_process` runs the
    learner and actors as tasks of this process over the in-process transport (debugging; the
    local launcher only)."""
    from longhorizon.common.metrics import read_metrics
    from longhorizon.launch.launchers.supervise import failure_of, last_error, launch
    from longhorizon.launch.report import diagnose, summarise_run

    resolved = _config(config, overrides)
    if in_process:
        code = _train_in_process(resolved)
    else:
        code = launch(resolved, progress=progress)
    run_dir = resolved.run_dir
    if code != 0:
        # The launcher's record names the failing rank and its error; a launcher without one
        # (a plug-in) leaves learner.log to tell.
        cause = failure_of(run_dir) or last_error(run_dir / "logs" / "learner.log")
        raise RunFailed(f"training ended with exit code {code}{f': {cause}' if cause else ''} "
                        f"(logs in {run_dir / 'logs'})", code)
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    summary = summarise_run(records) if records else {}
    return TrainResult(run_dir, records, summary, diagnose(summary) if records else [])


def _train_in_process(config: Config) -> int:
    import logging

    import trio

    from longhorizon.launch.launchers.local import train_in_process

    if config.run.launcher != "local":
        raise ConfigError(f"in-process training runs every role in this process, not with run.launcher = "
                          f"{config.run.launcher!r}: drop one of the two")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    trio.run(train_in_process, config)
    return 0


def evaluate(config: ConfigLike, overrides: Sequence[str] = (), *, checkpoint: str | Path | None = None,
             tasks: int = 100, samples: int = 1, k: Sequence[int] = (1,), horizon: int = 0,
             sweep: str | None = None, values: Sequence[int] = (), output_dir: str | Path | None = None,
             engine_options: dict[str, Any] | None = None) -> dict:
    """Evaluate as `longhorizon eval` does and return its JSON document (success rate with its
    interval, Pass@k, per category; a sweep's points under "points")."""
    from longhorizon.launch.recipes.eval import EvalRequest, evaluate_config, write_outputs

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


def collect(config: ConfigLike, overrides: Sequence[str] = (), *, output: str | Path,
            episodes: int | None = None, split: str | None = None, tasks: int = 0,
            only_successful: bool = False, model: str | None = None, horizon: int = 0,
            concurrency: int = 32, engine_options: dict[str, Any] | None = None, overwrite: bool = False,
            on_progress: Callable[[int, int, str], None] | None = None,
            note: Callable[[str], None] = print) -> "CollectSummary":
    """Play the config's env split with its engine and write the conversations to `output` (JSONL),
    as `longhorizon collect` does; returns what was played and written. `on_progress(done,
    total, detail)` follows the episodes."""
    from longhorizon.actor.collect import run_collect

    return run_collect(
        _config(config, overrides), output=output, episodes=episodes, split=split, only_successful=only_successful,
        model=model, horizon=horizon, concurrency=concurrency, engine_options=dict(engine_options or {}),
        overwrite=overwrite, max_tasks=tasks, on_progress=on_progress, on_note=note,
    )


def sft(config: ConfigLike, overrides: Sequence[str] = (), *, note: Callable[[str], None] = print) -> dict:
    """Supervised fine-tuning from the config's [sft] table, as `longhorizon sft` does; returns
    its summary (also in the run folder's sft_summary.json): the data, the loss, the checkpoint
    and, where asked, the held-out evaluation."""
    from longhorizon.launch.recipes.sft import run_sft

    return run_sft(_config(config, overrides), note=note)


def dpo(config: ConfigLike, overrides: Sequence[str] = (), *, note: Callable[[str], None] = print) -> dict:
    """Direct preference optimisation from the config's [dpo] table, as `longhorizon dpo` does;
    returns its summary (also in dpo_summary.json)."""
    from longhorizon.launch.recipes.dpo import run_dpo

    return run_dpo(_config(config, overrides), note=note)


def rft(config: ConfigLike, overrides: Sequence[str] = (), *, note: Callable[[str], None] = print) -> dict:
    """Rejection-sampling fine-tuning ([rft] and [sft]), as `longhorizon rft` does: rounds of
    sampling, keeping the successes and SFT on them; returns its summary (also in
    rft_summary.json)."""
    from longhorizon.launch.recipes.rft import run_rft

    return run_rft(_config(config, overrides), note=note)


def bench(name: str, *arguments: str) -> dict:
    """Run `longhorizon bench NAME ARGUMENTS...`, showing its tables, and return its result (the
    object the command prints as its last line)."""
    from longhorizon.launch.bench.cli import run
    from longhorizon.launch.bench.tables import BenchStopped

    try:
        return run([name, *arguments])
    except BenchStopped as stop:
        raise RunFailed(f"longhorizon bench {name}: {stop}", stop.exit_code) from None
