"""The freeze experiment: how often a learning config freezes, over several seeds.

`longhorizon experiment freezes CONFIG --runs N [--output DIR] [section.key=value ...]` trains the
config N times, one `longhorizon train` process after another, with run.seed = 0..N-1 (from
--first-seed), each into DIR/run-<seed>. Each run's metrics.jsonl then gets two verdicts:

- froze (`froze`): over its last steps the run stayed below the success level with most of its
  groups flat, or with its entropy near 0;
- steps to 95% (`steps_to_success`): the first step at which the moving average of training
  success reaches the level.

A freeze (docs/algorithms.md): a small policy turns deterministic on a wrong answer, every member
of a group plays alike, so nearly every group is flat (one reward for all its members, advantage
0) and nothing moves the policy again; the codebook runs that fail sit at a mean reward of about
0.75 with about 42% success. A solved run also ends mostly flat and near-deterministic (every
member succeeds), so the success level is what tells the two apart.

Outputs in DIR: one result file per run under results/ (a rerun with the same DIR and the same
settings reuses finished runs), freezes.json with every run and the summary, and the run folders.
It prints a table, then one line of JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from longhorizon.common.args import parse_args, positive_int
from longhorizon.common.processes import stop_process
from longhorizon.common.config import load_config
from longhorizon.common.metrics import read_metrics
from longhorizon.launch.checks import validate_config

LAST_STEPS = 10
"""Steps at the end of a run over which a freeze is judged."""
FLAT_SHARE = 0.8
"""Share of flat groups over those steps from which the rewards count as giving no signal."""
ENTROPY_FLOOR = 0.05
"""Nats per generated token; below it the policy is as good as deterministic."""
SUCCESS_LEVEL = 0.95
"""Training success that counts as solved."""
AVERAGE_WINDOW = 5
"""Steps the training success is averaged over for the steps to the success level."""
# Keys the experiment sets on every run itself.
_OWN_KEYS = ("run.seed", "run.name", "run.output_dir")


# --- verdicts over a run's records (pure functions) ---------------------------------------------


def step_entropy(record: dict) -> float | None:
    """The step's mean entropy per generated token, in nats: the whole next-token distribution's
    (`entropy`, logged when an entropy bonus or the target mode is on), else the sampled tokens'
    estimate, the mean of −log π (`entropy_estimate`). None when the step trained on nothing (every
    group flat and left out): then neither is logged."""
    for key in ("entropy", "entropy_estimate"):
        value = record.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            return float(value)
    return None


def flat_fraction(records: Sequence[dict]) -> float | None:
    """The share of the steps' groups that were flat (one reward for every member, so advantage
    0): `groups_skipped_zero_variance` over it plus `groups_used`. None when no group was scored.
    Algorithms that score the whole batch at once (reinforce_pp, ppo) count no group flat."""
    flat = sum(record.get("groups_skipped_zero_variance", 0) for record in records)
    used = sum(record.get("groups_used", 0) for record in records)
    return flat / (flat + used) if flat + used > 0 else None


def mean_entropy(records: Sequence[dict]) -> float | None:
    """The mean of `step_entropy` over the steps that logged one; None if none did."""
    values = [value for value in map(step_entropy, records) if value is not None]
    return sum(values) / len(values) if values else None


def froze(records: Sequence[dict], last: int = LAST_STEPS, flat_share: float = FLAT_SHARE,
          entropy_floor: float = ENTROPY_FLOOR, success_level: float = SUCCESS_LEVEL) -> bool:
    """Whether a run froze. Over its last `last` steps: the mean training success stayed below
    `success_level` (not solved), and either at least `flat_share` of the groups were flat or the
    mean entropy was below `entropy_floor`. A run of fewer steps is too short to tell: not frozen.

    The groups of a frozen policy split into all-success and all-failure groups, both flat, with
    a few left with signal by a rare different sample; a solved policy's groups are flat too, but
    it is above the success level. Below the level with most groups flat, the failures come
    whole groups at a time: the policy is sure of a wrong answer on those tasks, and nothing in
    the rewards tells it otherwise. A policy learning its way up has its failures spread over
    the groups, so most of them carry signal. Below the entropy floor the policy is as good as
    deterministic, which flags a freeze for algorithms that count no group flat."""
    if last < 1:
        raise ValueError(f"the steps a freeze is judged over must be at least 1, got {last}")
    if len(records) < last:
        return False
    window = records[-last:]
    if sum(record.get("success_rate", 0.0) for record in window) / last >= success_level:
        return False
    flat = flat_fraction(window)
    entropy = mean_entropy(window)
    return (flat is not None and flat >= flat_share) or (entropy is not None and entropy < entropy_floor)


def steps_to_success(records: Sequence[dict], level: float = SUCCESS_LEVEL, window: int = AVERAGE_WINDOW) -> int | None:
    """The step (its `step` number) at which the mean training success of that step and the
    `window` − 1 before it first reaches `level`; None if it never does. No average is taken
    before `window` steps exist, so one lucky early step does not count."""
    if window < 1:
        raise ValueError(f"the averaging window must be at least 1 step, got {window}")
    successes = [record.get("success_rate", 0.0) for record in records]
    for index in range(window - 1, len(records)):
        if sum(successes[index - window + 1: index + 1]) / window >= level:
            return int(records[index]["step"])
    return None


def final_entropy(records: Sequence[dict]) -> float | None:
    """The last entropy the run logged (`step_entropy`), None if it logged none."""
    for record in reversed(records):
        value = step_entropy(record)
        if value is not None:
            return value
    return None


@dataclass(frozen=True)
class Criteria:
    """The thresholds of the verdicts."""

    last: int = LAST_STEPS
    flat_share: float = FLAT_SHARE
    entropy_floor: float = ENTROPY_FLOOR
    success_level: float = SUCCESS_LEVEL
    window: int = AVERAGE_WINDOW


def analyse_run(records: Sequence[dict], criteria: Criteria = Criteria()) -> dict:
    """One run's figures: froze, steps to the success level, final success and entropy."""
    if not records:
        raise ValueError("the run logged no steps")
    window = records[-criteria.last:]
    return {
        "steps": len(records),
        "froze": froze(records, criteria.last, criteria.flat_share, criteria.entropy_floor, criteria.success_level),
        "steps_to_success": steps_to_success(records, criteria.success_level, criteria.window),
        "final_success": records[-1].get("success_rate", 0.0),
        "final_entropy": final_entropy(records),
        # The figures the verdict is made of, over the last steps.
        "success_at_end": sum(record.get("success_rate", 0.0) for record in window) / len(window),
        "flat_share_at_end": flat_fraction(window),
        "entropy_at_end": mean_entropy(window),
    }


def summarise(runs: Sequence[dict]) -> dict:
    """How many runs froze; the median steps to the success level over the runs that reached it."""
    reached = [run["steps_to_success"] for run in runs if run["steps_to_success"] is not None]
    return {
        "runs": len(runs),
        "frozen": sum(1 for run in runs if run["froze"]),
        "reached": len(reached),
        "median_steps_to_success": statistics.median(reached) if reached else None,
    }


def format_table(runs: Sequence[dict], summary: dict, criteria: Criteria = Criteria()) -> str:
    """A markdown table, one row per run, then the summary in a line."""
    def number(value, form: str) -> str:
        return "-" if value is None else format(value, form)

    level = f"{criteria.success_level:.0%}"
    header = ["seed", "froze", f"steps to {level}", "final success", "final entropy",
              f"last {criteria.last}: success, flat groups", "steps", "seconds"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for run in runs:
        lines.append("| " + " | ".join([
            str(run["seed"]), "yes" if run["froze"] else "no", number(run["steps_to_success"], "d"),
            f"{run['final_success']:.0%}", number(run["final_entropy"], ".3f"),
            f"{run['success_at_end']:.0%}, {number(run['flat_share_at_end'], '.0%')}", str(run["steps"]),
            number(run.get("seconds"), ".0f"),
        ]) + " |")
    median = summary["median_steps_to_success"]
    lines.append(f"frozen: {summary['frozen']} of {summary['runs']}; reached {level}: {summary['reached']} of "
                 f"{summary['runs']}, median step {number(median, 'g')}")
    return "\n".join(lines)


# --- the runs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What one invocation of the experiment runs."""

    config_path: Path
    output_dir: Path
    runs: int = 5
    first_seed: int = 0
    overrides: tuple[str, ...] = ()
    """section.key=value overrides applied to every run."""
    criteria: Criteria = Criteria()


def train_once(config_path: Path, overrides: Sequence[str], log_path: Path) -> float:
    """Run `longhorizon train` to its end, its output in `log_path`; the wall seconds it took."""
    command = [sys.executable, "-m", "longhorizon.launch.cli", "train", str(config_path), *overrides, "--no-plots"]
    started = time.monotonic()
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = process.wait()
        finally:
            # Interrupted: an orderly stop, the launcher ends its processes.
            stop_process(process, timeout_s=120)
    if code != 0:
        raise RuntimeError(f"a training run ended with exit code {code}; see {log_path}")
    return time.monotonic() - started


def _check_overrides(overrides: Sequence[str]) -> None:
    for override in overrides:
        key = override.partition("=")[0].strip()
        if key in _OWN_KEYS:
            raise ValueError(f"{key} is set by the experiment for each run; drop the override {override!r}")


def run_experiment(settings: Settings, progress=print) -> dict:
    """Train every seed in turn, judge each run; write freezes.json and return its document."""
    if settings.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {settings.runs}")
    _check_overrides(settings.overrides)
    output = settings.output_dir.resolve()
    config_path = settings.config_path.resolve()
    seeds = list(range(settings.first_seed, settings.first_seed + settings.runs))
    per_run = {seed: [*settings.overrides, f"run.seed={seed}", f"run.output_dir={str(output)!r}",
                      f"run.name='run-{seed}'"] for seed in seeds}
    for overrides in per_run.values():  # a bad key or value fails here, before any run starts
        validate_config(load_config(config_path, overrides))
    runs = []
    started = time.monotonic()
    for seed in seeds:
        overrides = per_run[seed]
        result_path = output / "results" / f"run-{seed}.json"
        if result_path.is_file():
            earlier = json.loads(result_path.read_text())
            if earlier.get("config") != str(config_path) or earlier.get("overrides") != overrides:
                raise ValueError(f"{result_path} was made with other settings; use another --output folder")
            progress(f"run-{seed}: finished earlier, reusing {result_path}")
        else:
            progress(f"run-{seed}: training ({time.monotonic() - started:.0f}s so far)")
            (output / "logs").mkdir(parents=True, exist_ok=True)
            # An unfinished earlier attempt in the run folder is moved aside by the launcher.
            seconds = train_once(config_path, overrides, output / "logs" / f"run-{seed}.log")
            earlier = {"seed": seed, "config": str(config_path), "overrides": overrides,
                       "seconds": round(seconds, 1), "run_dir": str(output / f"run-{seed}")}
            result_path.parent.mkdir(parents=True, exist_ok=True)
            result_path.write_text(json.dumps(earlier, indent=1))
        # The verdicts are worked out anew, so a rerun with other criteria reuses the runs.
        figures = analyse_run(read_metrics(Path(earlier["run_dir"]), required=True), settings.criteria)
        run = {"seed": seed, **figures, "seconds": earlier["seconds"], "run_dir": earlier["run_dir"]}
        runs.append(run)
        progress(f"run-{seed}: {run['steps']} steps, froze: {'yes' if run['froze'] else 'no'}, steps to "
                 f"{settings.criteria.success_level:.0%}: {run['steps_to_success']}, final success "
                 f"{run['final_success']:.0%}, {run['seconds']:.0f}s")
    criteria = settings.criteria
    document = {
        "experiment": "freezes",
        "config": str(settings.config_path),
        "overrides": list(settings.overrides),
        "criteria": {"last_steps": criteria.last, "flat_share": criteria.flat_share, "entropy_floor": criteria.entropy_floor,
                     "success_level": criteria.success_level, "average_window": criteria.window},
        "summary": summarise(runs),
        "runs": runs,
    }
    output.mkdir(parents=True, exist_ok=True)
    (output / "freezes.json").write_text(json.dumps(document, indent=1))
    return document


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longhorizon experiment freezes",
        description="Train a config several times with different seeds; count the runs that froze (below the "
                    "success level over their last steps, with most groups flat or the entropy near 0) and the "
                    "steps each took to "
                    "95% training success (docs/algorithms.md, Entropy control).",
    )
    parser.add_argument("config", type=Path, help="TOML config to train (e.g. configs/codebook.toml)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides for every run")
    parser.add_argument("--runs", type=positive_int, default=5, help="runs, one seed each (default %(default)s)")
    parser.add_argument("--first-seed", type=int, default=0, help="run.seed of the first run (default %(default)s)")
    parser.add_argument("--output", type=Path, help="output folder (default runs/freezes/<config name>)")
    parser.add_argument("--last-steps", type=positive_int, default=LAST_STEPS,
                        help="steps at the end of a run over which a freeze is judged (default %(default)s)")
    parser.add_argument("--flat-share", type=float, default=FLAT_SHARE,
                        help="share of flat groups over those steps that counts as no signal (default %(default)s)")
    parser.add_argument("--entropy-floor", type=float, default=ENTROPY_FLOOR,
                        help="nats per token below which a policy counts as deterministic (default %(default)s)")
    parser.add_argument("--success-level", type=float, default=SUCCESS_LEVEL,
                        help="training success that counts as solved (default %(default)s)")
    parser.add_argument("--window", type=positive_int, default=AVERAGE_WINDOW,
                        help="steps the training success is averaged over for the steps to the level "
                             "(default %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()

    def check(args: argparse.Namespace) -> None:
        if not 0 < args.success_level <= 1:
            raise ValueError(f"--success-level must be in (0, 1], got {args.success_level}")
        if not 0 < args.flat_share <= 1:
            raise ValueError(f"--flat-share must be in (0, 1], got {args.flat_share}")
        if args.entropy_floor < 0:
            raise ValueError(f"--entropy-floor must be at least 0, got {args.entropy_floor}")

    args = parse_args(parser, argv, check)
    if isinstance(args, int):
        return args
    output = args.output if args.output is not None else Path("runs") / "freezes" / args.config.stem
    settings = Settings(
        config_path=args.config, output_dir=output, runs=args.runs, first_seed=args.first_seed,
        overrides=tuple(args.overrides),
        criteria=Criteria(last=args.last_steps, flat_share=args.flat_share, entropy_floor=args.entropy_floor, success_level=args.success_level,
                          window=args.window),
    )
    if threading.current_thread() is threading.main_thread():
        # SIGTERM ends the experiment like Ctrl-C, so the training run under way is stopped too.
        signal.signal(signal.SIGTERM, _interrupt)
    document = run_experiment(settings, progress=lambda line: print(line, flush=True))
    print(format_table(document["runs"], document["summary"], settings.criteria))
    print(f"results: {output / 'freezes.json'}")
    compact = {"experiment": "freezes", "config": document["config"], "overrides": document["overrides"],
               **document["summary"],
               "runs_detail": [{key: run[key] for key in ("seed", "froze", "steps_to_success", "final_success",
                                                          "final_entropy")} for run in document["runs"]]}
    print(json.dumps(compact, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
