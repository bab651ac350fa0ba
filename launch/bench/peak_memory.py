"""`longhorizon bench peak-memory -- COMMAND ...`: the peak memory of a command and every process it starts.

It runs COMMAND, reads the memory of the command's whole process tree every `--interval-s`
seconds (PSS, the proportional set size: a page shared by several processes is split between
them, so the sum is what the tree takes from the machine; RSS beside it) and reports the largest
sum seen, the moment it was seen, and each command line's own peak. A run of several phases
(an experiment's SFT, evaluations, then a learner, actors and a vLLM worker) thus shows which
phase sets the machine's peak and which process holds it. The command's own output passes
through; its exit code is this command's.

Run: `longhorizon bench peak-memory -- .venv/bin/longhorizon experiment sft-rl configs/quickstart.toml`.
A table for people, then one line of JSON.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

import psutil

from longhorizon.launch.bench.memory import MIB
from longhorizon.launch.bench.tables import BenchStopped, Column, parsed, print_table, run_as_command

PROG = "longhorizon bench peak-memory"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longhorizon bench peak-memory", description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval-s", type=float, default=1.0, help="seconds between samples (default 1)")
    parser.add_argument("--top", type=int, default=8, help="processes listed by their own peak (default 8)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    return parser


def _label(process: psutil.Process) -> str:
    """A short name for a process: its command line's first words that are not the interpreter."""
    try:
        words = process.cmdline()
    except psutil.Error:
        return "?"
    words = [word for word in words if not word.endswith(("python", "python3", "python3.11"))]
    return " ".join(word.rsplit("/", 1)[-1] for word in words[:4])[:80] or process.name()


class TreeSampler:
    """Samples the memory of a process and its descendants on a thread of its own."""

    def __init__(self, pid: int, interval_s: float) -> None:
        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.started = time.monotonic()
        self.peak_pss = self.peak_rss = 0
        self.peak_at_s = 0.0
        self.peak_processes: dict[str, int] = {}
        self.by_label: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def sample(self) -> None:
        try:
            processes = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        pss_total = rss_total = 0
        current: dict[str, int] = {}
        for process in processes:
            try:
                info = process.memory_full_info()
            except psutil.Error:
                continue
            pss = getattr(info, "pss", info.rss)
            pss_total += pss
            rss_total += info.rss
            label = f"{process.pid} {_label(process)}"
            current[label] = pss
            self.by_label[label] = max(self.by_label.get(label, 0), pss)
        self.samples += 1
        self.peak_rss = max(self.peak_rss, rss_total)
        if pss_total > self.peak_pss:
            self.peak_pss, self.peak_at_s, self.peak_processes = pss_total, time.monotonic() - self.started, current

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(command: Sequence[str], interval_s: float) -> tuple[int, TreeSampler, float]:
    started = time.monotonic()
    process = subprocess.Popen(list(command))
    with TreeSampler(process.pid, interval_s) as sampler:
        code = process.wait()
    return code, sampler, time.monotonic() - started


def run(argv: Sequence[str]) -> dict[str, Any]:
    """Run the command after `--` while sampling its process tree, print the tables, return the
    figures (the command's exit code under "exit_code")."""
    args = parsed(build_parser(), argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise BenchStopped(2, "error: give the command to run after --")
    code, sampler, seconds = measure(command, args.interval_s)
    at_peak = sorted(sampler.peak_processes.items(), key=lambda item: -item[1])[:args.top]
    own_peaks = sorted(sampler.by_label.items(), key=lambda item: -item[1])[:args.top]
    print(f"{' '.join(command)}: exit code {code}, {seconds:.0f} s, {sampler.samples} samples; "
          f"peak {sampler.peak_pss / MIB:,.0f} MB PSS over the process tree at {sampler.peak_at_s:.0f} s "
          f"(largest RSS sum {sampler.peak_rss / MIB:,.0f} MB)")
    print_table([Column("process at the peak", 60), Column("PSS MB", 10, ",.0f")],
                [[label, value / MIB] for label, value in at_peak])
    print_table([Column("process", 60), Column("own peak PSS MB", 16, ",.0f")],
                [[label, value / MIB] for label, value in own_peaks])
    result: dict[str, Any] = {
        "command": command, "exit_code": code, "seconds": seconds, "samples": sampler.samples,
        "peak_pss_mb": sampler.peak_pss / MIB, "peak_rss_sum_mb": sampler.peak_rss / MIB,
        "peak_at_s": sampler.peak_at_s,
        "at_peak_mb": {label: value / MIB for label, value in at_peak},
        "own_peak_mb": {label: value / MIB for label, value in own_peaks},
    }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """As a command, the measured command's exit code is this one's."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_as_command(PROG, run, argv, exit_code=lambda result: result["exit_code"])
