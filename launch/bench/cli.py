"""`longhorizon bench NAME`: benchmarks that print a table for people and, last, one line of JSON.

NAME is one of:
- `transport`: raw ZeroMQ frames against Trajectory messages over tcp loopback (transport.py).
- `async-vs-sync`: one workload trained in async then sync mode, everything else identical
  (async_vs_sync.py).
- `envs`: env steps per second in-process and through the HTTP env service (envs.py).
- `sciworld-memory`: JVM and Python memory over many SciWorld episodes (sciworld.py).
- `all`: transport, async-vs-sync and envs, one after the other; the last line is the JSON of all.
- `search`, `web`, `generation`, `learner`, `weights`, `soak`, `env-service`, `peak-memory`, `gateway`,
  `model-server`, `worker-start`: benchmarks with their own options, in their own modules (`longhorizon bench NAME --help`).

Run: `longhorizon bench async-vs-sync [--steps N] [--token-latency-ms MS] [--actors N] ...`
(`--help` lists the options). A default async-vs-sync run takes under two minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

from longhorizon.common.args import positive_int
from longhorizon.launch.bench import async_vs_sync, transport, envs, sciworld
from longhorizon.launch.bench.tables import BenchStopped, parsed, run_as_command

BENCHMARKS = ("transport", "async-vs-sync", "envs", "sciworld-memory", "all")
STANDALONE_BENCHMARKS = {
    "search": "longhorizon.launch.bench.search",
    "web": "longhorizon.launch.bench.web",
    "generation": "longhorizon.launch.bench.generation",
    "learner": "longhorizon.launch.bench.learner",
    "weights": "longhorizon.launch.bench.weights",
    "soak": "longhorizon.launch.bench.soak",
    "env-service": "longhorizon.launch.bench.env_service",
    "peak-memory": "longhorizon.launch.bench.peak_memory",
    "gateway": "longhorizon.launch.bench.gateway",
    "model-server": "longhorizon.launch.bench.model_server",
    "worker-start": "longhorizon.launch.bench.worker_start",
}
"""Benchmarks with their own module and options: `longhorizon bench NAME ...` calls the module's
`main(argv)`, which prints a table for people and, last, one line of JSON; the Python API calls its
`run(argv)`, which returns the result."""


def _run_transport(args: argparse.Namespace) -> dict[str, Any]:
    result = transport.bench_transport(
        trajectory_bytes=args.trajectory_bytes,
        messages=args.transport_messages,
        rounds=args.transport_rounds,
        keep_freed_memory=not args.glibc_allocator,
    )
    transport.print_report(result)
    return result


def _settings_from(args: argparse.Namespace) -> async_vs_sync.AsyncVsSyncSettings:
    return async_vs_sync.AsyncVsSyncSettings(
        actors=args.actors,
        concurrent_groups=args.concurrent_groups,
        group_size=args.group_size,
        groups_per_step=args.groups_per_step,
        steps=args.steps,
        token_latency_s=args.token_latency_ms / 1000,
        long_fraction=args.long_fraction,
        max_staleness=args.max_staleness,
        rollout_slots=args.rollout_slots,
        seed=args.seed,
    )


def build_parser() -> argparse.ArgumentParser:
    defaults = async_vs_sync.AsyncVsSyncSettings()
    parser = argparse.ArgumentParser(
        prog="longhorizon bench",
        description="Benchmarks: a table for people, then one last line of JSON.",
        epilog="Also: " + ", ".join(f"`longhorizon bench {name} --help`" for name in STANDALONE_BENCHMARKS) + ".",
    )
    parser.add_argument("name", choices=BENCHMARKS, help="which benchmark to run")
    workload = parser.add_argument_group("async-vs-sync")
    workload.add_argument("--steps", type=int, default=defaults.steps, help="learner steps per mode (default %(default)s)")
    workload.add_argument(
        "--token-latency-ms", type=float, default=defaults.token_latency_s * 1000,
        help="simulated generation time per token, in ms (default %(default)s)",
    )
    workload.add_argument("--actors", type=int, default=defaults.actors, help="actor processes (default %(default)s)")
    workload.add_argument(
        "--concurrent-groups", type=int, default=defaults.concurrent_groups,
        help="groups in flight per actor (default %(default)s)",
    )
    workload.add_argument("--group-size", type=int, default=defaults.group_size, help="episodes per group (default %(default)s)")
    workload.add_argument(
        "--groups-per-step", type=int, default=defaults.groups_per_step,
        help="groups per learner step (default: actors x concurrent groups)",
    )
    workload.add_argument(
        "--long-fraction", type=float, default=defaults.long_fraction,
        help="share of long (15-30 turn) episodes (default %(default)s)",
    )
    workload.add_argument(
        "--max-staleness", type=int, default=defaults.max_staleness,
        help="async: largest policy lag accepted (default %(default)s)",
    )
    workload.add_argument(
        "--rollout-slots", choices=("group", "episode"), default=defaults.rollout_slots,
        help="async: what an actor's slot holds, a whole group or one episode (default %(default)s)",
    )
    workload.add_argument("--seed", type=int, default=defaults.seed, help="run seed (default %(default)s)")
    workload.add_argument(
        "--output-dir", default=None,
        help="keep the runs here (its async/ and sync/ folders are replaced; bench.json added) instead of a temporary folder",
    )
    transport = parser.add_argument_group("transport")
    transport.add_argument(
        "--trajectory-bytes", type=int, default=1 << 20, help="trajectory size in bytes (default %(default)s)"
    )
    transport.add_argument(
        "--transport-messages", type=positive_int, default=500, help="messages timed per run (default %(default)s)"
    )
    transport.add_argument(
        "--transport-rounds", type=positive_int, default=3,
        help="alternating rounds of each kind (default %(default)s)",
    )
    transport.add_argument(
        "--glibc-allocator", action="store_true",
        help="run both sides with glibc's allocator defaults instead of the settings our learner and actors use",
    )
    envs = parser.add_argument_group("envs")
    envs.add_argument(
        "--env", action="append", dest="envs", default=None,
        help="env to measure (repeatable; default codebook, textcraft, babyai)",
    )
    envs.add_argument("--env-seconds", type=float, default=5.0, help="seconds per env and mode (default %(default)s)")
    sciworld = parser.add_argument_group("sciworld-memory (not part of 'all': about 10 minutes)")
    sciworld.add_argument("--episodes", type=int, default=1000, help="SciWorld episodes (default %(default)s)")
    return parser


def _run_envs(args: argparse.Namespace) -> dict[str, Any]:
    result = envs.bench_env_steps(tuple(args.envs or envs.DEFAULT_ENVS), seconds=args.env_seconds)
    envs.print_report(result)
    return result


def run(argv: list[str]) -> dict[str, Any]:
    """Run the benchmark argv names with its options, print its tables and return its result
    (`all`: each one's result under its name); BenchStopped when it cannot."""
    if argv and argv[0] in STANDALONE_BENCHMARKS:
        return importlib.import_module(STANDALONE_BENCHMARKS[argv[0]]).run(argv[1:])
    args = parsed(build_parser(), argv, check=lambda args: _settings_from(args).check())
    settings = _settings_from(args)
    results: dict[str, Any] = {}
    if args.name in ("transport", "all"):
        results["transport"] = _run_transport(args)
    if args.name in ("async-vs-sync", "all"):
        try:
            result = async_vs_sync.bench_async_vs_sync(settings, output_dir=args.output_dir)
        except RuntimeError as error:
            raise BenchStopped(1, str(error)) from error
        if args.output_dir is not None:
            (Path(args.output_dir) / "bench.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        results["async_vs_sync"] = result
        async_vs_sync.print_report(result)
    if args.name == "sciworld-memory":
        results["sciworld_memory"] = sciworld.bench_sciworld_memory(args.episodes)
        sciworld.print_report(results["sciworld_memory"])
    if args.name in ("envs", "all"):
        try:
            results["envs"] = _run_envs(args)
        except ValueError as error:
            raise BenchStopped(2, f"error: {error}") from error
    return results if args.name == "all" else next(iter(results.values()))


def main(argv: list[str]) -> int:
    if argv and argv[0] in STANDALONE_BENCHMARKS:
        # Their own main: some have modes of their own (a process they start, an exit code they pass on).
        return int(importlib.import_module(STANDALONE_BENCHMARKS[argv[0]]).main(argv[1:]))
    return run_as_command("longhorizon bench", run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
