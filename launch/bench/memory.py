"""The memory figures benchmarks report: what processes hold now, and the peak over a stretch of work.

The resident set size (RSS) counts every page a process has in memory, pages it shares with other
processes included; the proportional set size (PSS) splits each shared page between the processes
sharing it, and the unique set size (USS) counts only the pages no other process shares. PSS and
USS come from the kernel's per-mapping tables (/proc/PID/smaps on Linux), which take longer to
read, so they are read only when asked for.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

MIB = 2**20
GIB = 2**30


@dataclass(frozen=True)
class MemoryUse:
    """Memory of a set of processes, summed over those that could be read."""

    processes: int
    """How many processes were read: 0 when none is alive (or ours to read)."""
    rss_bytes: int
    pss_bytes: int | None
    """Only when read in detail; where the system does not tell, each process's RSS stands in."""
    uss_bytes: int | None
    """Only when read in detail."""


def memory_use(pids: Iterable[int] | None = None, *, children: bool = False, detailed: bool = False) -> MemoryUse:
    """The memory of the processes `pids` (default: this one), with all their descendants when
    `children`, and their PSS and USS too when `detailed`. A process that has ended, or that we
    may not read, is left out."""
    processes: list[psutil.Process] = []
    for pid in [os.getpid()] if pids is None else pids:
        try:
            process = psutil.Process(pid)
            processes.append(process)
            if children:
                processes.extend(process.children(recursive=True))
        except psutil.Error:
            continue
    read = rss = pss = uss = 0
    for process in processes:
        try:
            info = process.memory_full_info() if detailed else process.memory_info()
        except psutil.Error:
            continue
        read += 1
        rss += info.rss
        if detailed:
            pss += getattr(info, "pss", info.rss)
            uss += info.uss
    return MemoryUse(read, rss, pss if detailed else None, uss if detailed else None)


class PeakRss:
    """This process's resident memory sampled in a thread while a `with` block runs: its peak, and
    how far that is above the value at the start.

    Sampling can miss a peak shorter than `interval_s`; the value at the end is always counted.
    """

    def __init__(self, interval_s: float = 0.05):
        self._process = psutil.Process()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.start_bytes = self._process.memory_info().rss
        self.peak_bytes = self.start_bytes
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    @property
    def added_mb(self) -> float:
        return (self.peak_bytes - self.start_bytes) / MIB


def reset_peak_rss() -> bool:
    """Start this process's peak resident memory afresh (/proc/self/clear_refs); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory since it started or since reset_peak_rss."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
