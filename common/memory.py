"""Allocator settings for processes that stream large messages: keep freed buffers for reuse.

glibc's malloc serves a block larger than its mmap threshold with a fresh mapping, and it hands
free memory at the top of a heap back to the kernel once that exceeds its trim threshold. Both
thresholds adapt to the largest block freed so far, so they end up near one message's size. A
learner receiving 1 MiB trajectories (ZeroMQ allocates each in its I/O thread, Python frees it
later) and an actor encoding them then keep returning pages and faulting them in again, each
page zeroed by the kernel: `longhorizon bench transport` measured about 150 us of extra CPU per
1 MiB trajectory from this alone. Fixing the thresholds keeps freed message buffers in the heap,
where the next message reuses them.

The price is memory: each malloc arena may keep up to ``TRIM_THRESHOLD_BYTES`` of freed memory
instead of returning it. Blocks larger than ``MMAP_THRESHOLD_BYTES`` (whole weight tensors) are
still mapped and unmapped on their own.
"""

import ctypes
import logging
import platform

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks up to this size come from the heap (glibc's largest allowed value on 64-bit)."""

TRIM_THRESHOLD_BYTES = 128 << 20
"""Free memory an arena keeps at its top before giving it back: several full receive queues."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_applied = False


def keep_freed_message_memory() -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module text).

    Process-wide and idempotent. Returns True when the settings are in force, False where the C
    library is not glibc (nothing is changed there).
    """
    global _applied
    if _applied:
        return True
    if platform.libc_ver()[0] != "glibc":
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
