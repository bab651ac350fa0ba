"""`longhorizon bench async-vs-sync`: one workload trained twice, mode=async then mode=sync.

Everything else is identical: the same actor processes (launched by launch_local over real ZMQ),
the same number of concurrent episodes, the long-tailed `longtail` env played by the scripted
engine with a simulated per-token latency, a tiny model trained by the learner, the same
groups_per_step and steps. Throughput is episodes consumed by the learner per second over the
steady state (from the first learner step's time to the last, so process start-up is excluded).

Run: `longhorizon bench async-vs-sync [--steps N] [--token-latency-ms MS] [--actors N] ...`
(`longhorizon bench --help` lists the options). A default run takes under two minutes on 2 CPU
cores.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from longhorizon.launch.bench.tables import Column, print_table
from longhorizon.common.config import config_from_dict
from longhorizon.common.models import build_tiny_model, load_tokenizer
from longhorizon.common.metrics import read_metrics
from longhorizon.launch.launchers.local import launch_local
from longhorizon.envs.toy.longtail import LengthDistribution

MODES = ("async", "sync")
TARGET_SPEEDUP = 2.0
"""Async should consume episodes at least this many times faster than sync on this workload."""

# The byte tokenizer of the scripted engine emits ids 0..258; a word-level tiny model with 260
# words (plus its specials and role words) has a vocabulary comfortably above that. Its words are
# never used: the learner only needs every token id below the vocabulary size, and its pad id only
# fills positions that the attention and loss masks exclude.
_TINY_MODEL_WORDS = [f"w{index}" for index in range(260)]
_BYTE_VOCAB_SIZE = 259
# One layer of width 32: on 2 CPU cores the learner then trains a 32-episode batch in well under a
# second, standing in for a GPU learner that is fast next to generation. A bigger model here would
# make both modes learner-bound and measure the CPU, not the asynchrony.
_TINY_MODEL_SHAPE = {"hidden_size": 32, "num_layers": 1, "num_heads": 2}


@dataclass(frozen=True)
class AsyncVsSyncSettings:
    """The workload both modes run; only run.mode differs between them."""

    actors: int = 2
    """Actor processes."""
    concurrent_groups: int = 4
    """Groups each actor keeps in flight (async), or generates at once (sync)."""
    group_size: int = 4
    """Episodes per GRPO group."""
    groups_per_step: int = 0
    """Groups per learner step; 0 means actors x concurrent_groups, so a sync batch is exactly
    what the actors can run at once and neither mode has idle episode slots by design."""
    steps: int = 20
    """Learner steps per mode; the steady state spans steps 1..steps."""
    token_latency_s: float = 0.003
    """Simulated generation time per generated token."""
    long_fraction: float = 0.125
    """Share of episodes drawn from the long part of the length mixture."""
    short_turns: tuple[int, int] = (1, 3)
    """Turn range of short episodes (final answer included)."""
    long_turns: tuple[int, int] = (15, 30)
    """Turn range of long episodes; the horizon cap is set to its upper end, so nothing is cut."""
    max_staleness: int = 4
    """Async only (sync uses 0 by construction): groups staler than this are dropped."""
    rollout_slots: str = "group"
    """Async only: what an actor's slot holds (actor.rollout_slots), `group` or `episode`."""
    seed: int = 0
    """Run seed (task sampling, episode lengths, model initialisation)."""

    @property
    def batch_groups(self) -> int:
        return self.groups_per_step or self.actors * self.concurrent_groups

    def check(self) -> None:
        """Raise ValueError naming the first setting that cannot run."""
        positive = {
            "actors": self.actors,
            "concurrent_groups": self.concurrent_groups,
            "group_size": self.group_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1, got {value}")
        if self.group_size < 2:
            raise ValueError(f"group-size must be at least 2 (GRPO needs two members), got {self.group_size}")
        if self.groups_per_step < 0:
            raise ValueError(f"groups-per-step must be >= 0 (0: actors x concurrent groups), got {self.groups_per_step}")
        if self.steps < 2:
            raise ValueError(f"steps must be at least 2 (the steady state spans first to last step), got {self.steps}")
        if self.token_latency_s < 0:
            raise ValueError(f"token latency must be >= 0, got {self.token_latency_s}")
        if not 0 <= self.long_fraction <= 1:
            raise ValueError(f"long-fraction must be between 0 and 1, got {self.long_fraction}")
        if self.max_staleness < 0:
            raise ValueError(f"max-staleness must be >= 0, got {self.max_staleness}")
        if self.rollout_slots not in ("group", "episode"):
            raise ValueError(f"rollout-slots must be group or episode, got {self.rollout_slots!r}")

        LengthDistribution(short_turns=self.short_turns, long_turns=self.long_turns, long_fraction=self.long_fraction)


def bench_config(settings: AsyncVsSyncSettings, mode: str, output_dir: Path, model_folder: Path):
    """The full run config of one mode; the two modes' configs differ in run.mode and run.name only."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    horizon_cap = max(settings.short_turns[1], settings.long_turns[1])
    return config_from_dict(
        {
            "run": {
                "name": mode, "output_dir": str(output_dir), "seed": settings.seed, "mode": mode,
                "total_steps": settings.steps,
            },
            "model": {"path": str(model_folder), "cache_dir": str(output_dir / "models")},
            "env": {
                "name": "longtail",
                "options": {
                    "short_turns": list(settings.short_turns),
                    "long_turns": list(settings.long_turns),
                    "long_fraction": settings.long_fraction,
                },
            },
            "actor": {
                "num_actors": settings.actors,
                "engine": "scripted",
                "scripted_policy": "oracle",
                "group_size": settings.group_size,
                "concurrent_groups": settings.concurrent_groups,
                "rollout_slots": settings.rollout_slots,
                "simulated_token_latency_s": settings.token_latency_s,
            },
            "learner": {
                "groups_per_step": settings.batch_groups,
                "max_staleness": settings.max_staleness,
                # One checkpoint at the end: the same cost in both modes, outside the window.
                "checkpoint_every": settings.steps,
            },
            "horizon": {"schedule": "fixed", "stages": [horizon_cap]},
        }
    )


def consumed_groups(record: dict) -> int:
    """Groups one learner step took from the buffer, whether or not they carried signal."""
    return (
        int(record.get("groups_used", 0))
        + int(record.get("groups_skipped_zero_variance", 0))
        + int(record.get("groups_skipped_too_small", 0))
    )


def steady_state(records: list[dict], group_size: int) -> dict[str, float]:
    """Throughput and staleness of one run from its per-step metrics records.

    The window runs from the first step's `time` to the last's: the episodes consumed by steps
    2..N over that span, so start-up and the first batch's fill are left out. Groups are counted
    as complete (`group_size` episodes): the bench's group timeout is far longer than a run.
    """
    if len(records) < 2:
        raise ValueError(f"need at least two learner steps to measure a steady state, got {len(records)}")
    seconds = float(records[-1]["time"]) - float(records[0]["time"])
    if seconds <= 0:
        raise ValueError(f"the steps' times do not increase ({records[0]['time']} .. {records[-1]['time']})")
    episodes = sum(consumed_groups(record) for record in records[1:]) * group_size
    return {
        "steps": len(records),
        "window_seconds": seconds,
        "window_episodes": episodes,
        "episodes_per_s": episodes / seconds,
        "seconds_per_step": seconds / (len(records) - 1),
        # Every step consumes the same number of groups, so the mean of the per-step means is the
        # mean over all consumed episodes.
        "staleness_mean": sum(float(r.get("staleness_mean", 0.0)) for r in records) / len(records),
        "staleness_max": max(int(r.get("staleness_max", 0)) for r in records),
        "groups_dropped_stale": int(records[-1].get("groups_dropped_stale", 0)),
        "turns_mean": sum(float(r.get("episode_turns_mean", 0.0)) for r in records) / len(records),
        "reward_mean": sum(float(r.get("reward_mean", 0.0)) for r in records) / len(records),
        "learner_step_seconds": sum(float(r.get("learner_step_seconds", 0.0)) for r in records) / len(records),
        "groups_used": sum(int(r.get("groups_used", 0)) for r in records),
    }


def build_bench_model(folder: Path) -> Path:
    """A tiny random model whose vocabulary covers every byte-tokenizer id the actors send."""
    if not (folder / "config.json").is_file():
        build_tiny_model(folder, words=_TINY_MODEL_WORDS, **_TINY_MODEL_SHAPE)
    vocab_size = len(load_tokenizer(folder))
    if vocab_size < _BYTE_VOCAB_SIZE:
        raise RuntimeError(f"the bench model's vocabulary ({vocab_size}) does not cover byte tokens")
    return folder


def run_mode(
    settings: AsyncVsSyncSettings, mode: str, output_dir: Path, model_folder: Path,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Train one mode with launch_local and measure it; raises RuntimeError if the run failed."""
    config = bench_config(settings, mode, output_dir, model_folder)
    if config.run_dir.exists():
        shutil.rmtree(config.run_dir)  # metrics.jsonl is appended to; a stale one would mix runs
    started = time.monotonic()
    code = launch_local(config, progress=lambda line: progress(f"[{mode}] {line}"))
    wall_seconds = time.monotonic() - started
    records = read_metrics(config.run_dir)
    if code != 0 or len(records) < settings.steps:
        raise RuntimeError(
            f"the {mode} run failed (exit code {code}, {len(records)} of {settings.steps} steps); "
            f"logs in {config.run_dir / 'logs'}"
        )
    result = steady_state(records, settings.group_size)
    result["wall_seconds"] = wall_seconds
    return result


def bench_async_vs_sync(
    settings: AsyncVsSyncSettings = AsyncVsSyncSettings(),
    *,
    output_dir: str | Path | None = None,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Run the workload in async then sync mode; returns a flat dict of figures (see print_report).

    Without `output_dir` the runs go to a temporary folder, removed afterwards unless a run
    failed (its logs are then kept and named in the error).
    """
    settings.check()
    temporary = output_dir is None
    root = Path(tempfile.mkdtemp(prefix="longhorizon-bench-")) if temporary else Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    model_folder = build_bench_model(root / "models" / "tiny-bench")
    per_mode: dict[str, dict] = {}
    for mode in MODES:
        per_mode[mode] = run_mode(settings, mode, root, model_folder, progress)
    if temporary:
        shutil.rmtree(root, ignore_errors=True)
    result: dict[str, Any] = {
        "benchmark": "async-vs-sync",
        "actors": settings.actors,
        "concurrent_groups": settings.concurrent_groups,
        "concurrent_episodes": settings.actors * settings.concurrent_groups * settings.group_size,
        "group_size": settings.group_size,
        "groups_per_step": settings.batch_groups,
        "steps": settings.steps,
        "token_latency_s": settings.token_latency_s,
        "long_fraction": settings.long_fraction,
        "short_turns": list(settings.short_turns),
        "long_turns": list(settings.long_turns),
        "max_staleness": settings.max_staleness,
        "rollout_slots": settings.rollout_slots,
        "seed": settings.seed,
        "output_dir": None if temporary else str(root),
    }
    for mode, figures in per_mode.items():
        result.update({f"{mode}_{key}": value for key, value in figures.items()})
    result["speedup"] = per_mode["async"]["episodes_per_s"] / per_mode["sync"]["episodes_per_s"]
    result["target_speedup"] = TARGET_SPEEDUP
    result["meets_target"] = result["speedup"] >= TARGET_SPEEDUP
    return result


def print_report(result: dict[str, Any]) -> None:
    """A table for people (the command prints the result as JSON after it)."""
    print(
        f"async vs sync: {result['actors']} actors x {result['concurrent_groups']} groups x "
        f"{result['group_size']} episodes in flight, {result['groups_per_step']} groups per step, "
        f"{result['steps']} steps, {result['token_latency_s'] * 1000:g} ms/token, "
        f"{result['long_fraction']:.0%} long episodes, async slots of one {result['rollout_slots']}"
    )
    figures = [
        (Column("episodes/s", 11, ".2f"), "episodes_per_s"),
        (Column("s/step", 8, ".2f"), "seconds_per_step"),
        (Column("staleness", 10, ".2f"), "staleness_mean"),
        (Column("max stale", 10, "d"), "staleness_max"),
        (Column("dropped", 8, "d"), "groups_dropped_stale"),
        (Column("turns", 6, ".2f"), "turns_mean"),
        (Column("train s", 8, ".2f"), "learner_step_seconds"),
        (Column("wall s", 7, ".1f"), "wall_seconds"),
    ]
    print_table(
        [Column("mode", 6, left=True), *(column for column, _ in figures)],
        [[mode, *(result[f"{mode}_{key}"] for _, key in figures)] for mode in MODES],
    )
    verdict = "meets" if result["meets_target"] else "misses"
    print(f"speed-up async / sync = {result['speedup']:.2f}x ({verdict} the target {result['target_speedup']:.1f}x)")
