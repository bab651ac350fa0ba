"""Memory of this process and of its machine: the figures a learner step reports, and the warning a
run gives before the kernel's out-of-memory killer picks one of its processes.

The machine's memory is what /proc/meminfo says is available, or less where this process runs in
a cgroup (v2) with a memory limit: a container's limit is what the OOM killer enforces there.
Everything reads /proc and /sys and costs well under a millisecond; off Linux the figures are
absent (None) and no warning is given.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

LOW_MEMORY_FRACTION = 0.1
"""Below this share of the machine's memory left available, the learner warns."""

_MEMINFO = Path("/proc/meminfo")
_CGROUP = Path("/sys/fs/cgroup")
MIB = 1 << 20


def peak_rss_bytes() -> int | None:
    """The largest resident set this process has had so far (at least its resident set now: the
    kernel updates its high-water mark lazily, so it can trail the current figure by a few pages)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if sys.platform.startswith("linux"):
        return max(peak * 1024, rss_bytes() or 0)  # Linux reports KiB
    if sys.platform == "darwin":
        return peak  # macOS reports bytes
    return None


def rss_bytes() -> int | None:
    """This process's resident set now (Linux), else None."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def parse_meminfo(text: str) -> tuple[int, int] | None:
    """(available, total) bytes from the text of /proc/meminfo, or None when either line is missing."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if name in ("MemAvailable", "MemTotal") and parts and parts[0].isdigit():
            values[name] = int(parts[0]) * 1024  # the file's unit is kB (KiB)
    if len(values) < 2:
        return None
    return values["MemAvailable"], values["MemTotal"]


def cgroup_limit(limit_text: str, usage_text: str) -> tuple[int, int] | None:
    """(available, limit) bytes from a cgroup v2 `memory.max` and `memory.current`; None without a limit."""
    limit_text, usage_text = limit_text.strip(), usage_text.strip()
    if not limit_text.isdigit() or not usage_text.isdigit():
        return None  # "max": no limit
    limit = int(limit_text)
    return max(limit - int(usage_text), 0), limit


def machine_memory() -> tuple[int, int] | None:
    """(available, total) bytes for the processes of this machine or container, or None."""
    try:
        machine = parse_meminfo(_MEMINFO.read_text())
    except OSError:
        return None
    if machine is None:
        return None
    try:
        limited = cgroup_limit((_CGROUP / "memory.max").read_text(), (_CGROUP / "memory.current").read_text())
    except OSError:
        limited = None
    if limited is not None and limited[1] < machine[1]:
        return min(limited[0], machine[0]), limited[1]
    return machine


def low_memory_message(available: int, total: int, fraction: float = LOW_MEMORY_FRACTION) -> str | None:
    """The warning to give when less than `fraction` of `total` is `available`, else None."""
    if total <= 0 or available >= fraction * total:
        return None
    return (f"{available / 2**30:.1f} GiB of this machine's {total / 2**30:.1f} GiB memory is left: the kernel kills "
            "a process when none is left (a learner killed so is restarted from its checkpoint, losing the "
            "trajectories it held). Lower learner.max_tokens_per_micro_batch or actor.max_batch_size, or give "
            "the run more memory")


class LowMemoryWarning:
    """Says `low_memory_message` once when available memory falls below `fraction` of the total,
    and again only after it has recovered past twice that share (no warning every step while a
    run sits near the line)."""

    def __init__(self, fraction: float = LOW_MEMORY_FRACTION) -> None:
        self.fraction = fraction
        self.warned = False

    def check(self, available: int, total: int) -> str | None:
        if self.warned:
            self.warned = total > 0 and available < 2 * self.fraction * total
            return None
        message = low_memory_message(available, total, self.fraction)
        self.warned = message is not None
        return message


def memory_figures() -> dict:
    """This process's and the machine's memory in MiB, as a step's record holds them (absent where unknown)."""
    figures = {}
    peak, now = peak_rss_bytes(), rss_bytes()
    if peak is not None:
        figures["rss_peak_mb"] = round(peak / MIB, 1)
    if now is not None:
        figures["rss_mb"] = round(now / MIB, 1)
    machine = machine_memory()
    if machine is not None:
        figures["memory_available_mb"] = round(machine[0] / MIB, 1)
        figures["memory_total_mb"] = round(machine[1] / MIB, 1)
    return figures
