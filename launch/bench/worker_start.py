"""`longhorizon bench worker-start`: what starting a run's processes costs, forked or fresh.

It runs the same short training run (`longhorizon train CONFIG`, a few steps) with
`run.fork_server` off and on, alternating, for several rounds, and measures each run's wall time
and the CPU time of its whole process tree (the launcher, the fork server and every worker: the
kernel adds a child's CPU time to its parent's when the parent reaps it). The runs train the same
steps, so the difference between the two modes is what the starts cost; divided by the number of
worker processes it is the saving per start.

Run: `longhorizon bench worker-start [--rounds 3] [--steps 3] [--actors 2] [CONFIG]`.
A table for people, then one line of JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from longhorizon.common.args import positive_int
from longhorizon.common.config import ConfigError, find_config
from longhorizon.launch.bench.tables import BenchStopped, Column, load_average, parsed, print_table, run_as_command

PROG = "longhorizon bench worker-start"
MODES = {"fresh": "false", "forked": "true"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="codebook",
                        help="a config file or the name of a shipped one (default codebook)")
    parser.add_argument("--rounds", type=positive_int, default=3, help="runs per mode (default 3)")
    parser.add_argument("--steps", type=positive_int, default=3, help="learner steps per run (default 3)")
    parser.add_argument("--actors", type=positive_int, default=2, help="actor processes per run (default 2)")
    return parser


def train_command(config: Path, output_dir: Path, overrides: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "longhorizon.launch.cli", "train", str(config),
            f"run.output_dir={str(output_dir)!r}", *overrides, "--no-plots"]


def timed_run(command: Sequence[str]) -> dict[str, float]:
    """Run `command`: its wall time and the CPU time of its process tree (the command's own and
    that of every descendant reaped along the way)."""
    started = time.monotonic()
    process = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    wall_s = time.monotonic() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise BenchStopped(1, f"the run failed (exit {process.returncode}): {output.decode(errors='replace')[-2000:]}")
    return {"wall_s": wall_s, "cpu_s": usage.ru_utime + usage.ru_stime}


def run(argv: Sequence[str]) -> dict[str, Any]:
    args = parsed(build_parser(), argv)
    try:
        config = find_config(args.config).resolve()
    except ConfigError as error:
        raise BenchStopped(2, str(error)) from None
    processes = 1 + args.actors
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    print(f"{PROG}: {config.name}, {args.steps} steps, 1 learner and {args.actors} actors, "
          f"{args.rounds} rounds; load average {load_average()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="longhorizon-worker-start-") as scratch:
        for round_index in range(args.rounds):
            for mode, value in MODES.items():
                figures = timed_run(train_command(config, Path(scratch) / f"{mode}-{round_index}", [
                    f"run.total_steps={args.steps}", f"actor.num_actors={args.actors}", f"run.fork_server={value}",
                    f"run.name={mode!r}",
                ]))
                runs[mode].append(figures)
                print(f"  round {round_index + 1} {mode:>6}: {figures['cpu_s']:6.1f} s CPU, {figures['wall_s']:5.1f} s wall",
                      flush=True)
    medians = {mode: {key: statistics.median(run[key] for run in rows) for key in ("cpu_s", "wall_s")}
               for mode, rows in runs.items()}
    print_table(
        [Column("mode", 8, left=True), Column("CPU s (median)", 15, ".1f"), Column("wall s (median)", 16, ".1f"),
         Column("CPU s (runs)", 24)],
        [[mode, medians[mode]["cpu_s"], medians[mode]["wall_s"],
          " ".join(f"{run['cpu_s']:.1f}" for run in runs[mode])] for mode in MODES],
    )
    saved_per_start = (medians["fresh"]["cpu_s"] - medians["forked"]["cpu_s"]) / processes
    print(f"CPU saved per worker start (median difference over {processes} processes): {saved_per_start:.1f} s")
    return {"config": str(config), "steps": args.steps, "actors": args.actors, "rounds": args.rounds,
            "runs": runs, "medians": medians, "cpu_saved_per_start_s": saved_per_start,
            "load_average": load_average()}


def main(argv: Sequence[str] | None = None) -> int:
    return run_as_command(PROG, run, sys.argv[1:] if argv is None else list(argv))
