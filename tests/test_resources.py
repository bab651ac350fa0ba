"""Memory figures of a process and its machine (common/resources.py), and the low-memory warning."""

import pytest

from longhorizon.common.resources import (
    LowMemoryWarning,
    cgroup_limit,
    low_memory_message,
    machine_memory,
    memory_figures,
    parse_meminfo,
    peak_rss_bytes,
    rss_bytes,
)

GIB = 1 << 30

MEMINFO = """MemTotal:       24576000 kB
MemFree:         1024000 kB
MemAvailable:    2048000 kB
Buffers:           10240 kB
"""


def test_meminfo_gives_available_and_total_in_bytes():
    assert parse_meminfo(MEMINFO) == (2048000 * 1024, 24576000 * 1024)
    assert parse_meminfo("MemTotal: 100 kB\n") is None  # an old kernel without MemAvailable


def test_a_cgroup_limit_counts_only_when_set():
    assert cgroup_limit("max\n", "123\n") is None
    assert cgroup_limit("1000\n", "600\n") == (400, 1000)
    assert cgroup_limit("1000", "1200") == (0, 1000)  # over the limit: nothing left, not a negative


def test_the_warning_comes_below_a_tenth_and_names_the_figures():
    assert low_memory_message(3 * GIB, 24 * GIB) is None
    message = low_memory_message(2 * GIB, 24 * GIB)
    assert message.startswith("2.0 GiB of this machine's 24.0 GiB memory is left")
    assert "learner.max_tokens_per_micro_batch" in message


def test_the_warning_is_given_once_until_memory_recovers():
    warning = LowMemoryWarning(fraction=0.1)
    assert warning.check(50, 100) is None
    assert warning.check(9, 100) is not None
    assert warning.check(5, 100) is None and warning.check(15, 100) is None  # still near the line
    assert warning.check(25, 100) is None  # recovered past a fifth
    assert warning.check(8, 100) is not None  # low again: said again


@pytest.mark.skipif(rss_bytes() is None, reason="reads /proc/self/statm (Linux)")
def test_this_process_figures_grow_with_what_it_holds():
    before = peak_rss_bytes()
    held = bytearray(256 << 20)
    held[::4096] = b"x" * len(held[::4096])  # touch every page so it is resident
    assert rss_bytes() >= 256 << 20
    assert peak_rss_bytes() >= max(before, 256 << 20)
    available, total = machine_memory()
    assert 0 < available <= total
    figures = memory_figures()
    assert figures["rss_peak_mb"] >= 256 and figures["memory_total_mb"] > figures["memory_available_mb"] > 0
    del held
