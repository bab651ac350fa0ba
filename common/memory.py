"""Allocator settings for processes that stream large messages: keep freed buffers for reuse.

glibc's malloc serves a block larger than its mmap threshold with a fresh mapping, and it hands
free memory at the top of a heap back to the kernel once that exceeds its trim threshold. Both
thresholds adapt to the largest block freed so far, so they end up near one message's size. A
learner receiving 1 MiB trajectories (ZeroMQ allocates each in its I/O thread, Python frees it
later) and an actor encoding them then keep returning pages and faulting them in again, each
page zeroed by the kernel: on 2 cores this cost the receiving process 130-230 us of CPU per 1 MiB
message (docs/benchmarks.md, Transport), about as much as receiving it. Fixing the thresholds keeps freed message buffers in the heap,
where the next message reuses them.

The price is memory, and it is process-wide: every allocation up to ``MMAP_THRESHOLD_BYTES`` (numpy
arrays, torch CPU tensors) now comes from a heap, each malloc arena keeps up to
``TRIM_THRESHOLD_BYTES`` of free memory at its top, and, as always with heaps, freed blocks below
a live one stay with the process until they are reused. Blocks larger than the threshold (whole
weight tensors) are still mapped and unmapped on their own. Processes started by fork inherit the
settings; processes spawned fresh (vLLM's engine core) do not.

Nothing is changed where the C library is not glibc, or where another allocator (jemalloc,
tcmalloc) is preloaded: glibc's mallopt would report success there without any effect.
"""

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks up to this size come from a heap: the largest value every 64-bit glibc accepts, and
more than any trajectory message."""

TRIM_THRESHOLD_BYTES = 128 << 20
"""Free memory an arena keeps at its top before giving it back: several full receive queues."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_applied = False


def _is_glibc_malloc() -> bool:
    """Whether malloc in this process is glibc's own (not another C library, not preloaded)."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):
        return False
    if not version or not version.startswith("glibc"):
        return False
    preloaded = os.environ.get("LD_PRELOAD", "")
    return not any(name in preloaded for name in ("jemalloc", "tcmalloc", "mimalloc"))


def keep_freed_message_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module text).

    Process-wide and idempotent. Returns True when the settings are in force, False where the C
    library is not glibc (nothing is changed there).
    """
    global _applied
    if _applied:
        return True
    if not _is_glibc_malloc():
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 when it refuses a value.
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) != 1:
        logger.warning("glibc refused the allocator settings for message buffers; running with its defaults")
        return False
    _applied = True
    return True


def keeping_freed_message_memory() -> bool:
    """Whether this process runs with the settings (they cannot be undone once applied)."""
    return _applied
