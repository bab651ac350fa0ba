"""The allocator settings that learner and actor processes apply for large messages."""

import subprocess
import sys

import pytest

from longhorizon.common import memory

# Receives 1 MiB messages from a sender process, as the learner does, and prints the minor page
# faults the receiving process took per message.
_RECEIVER = """
import resource, sys
from longhorizon.common.memory import keep_freed_message_memory
from longhorizon.launch.bench.transport import _measure

if __name__ == "__main__":
    keep = sys.argv[1] == "keep"
    if keep:
        assert keep_freed_message_memory()
    _measure("raw", 50, 1 << 20, keep)  # start-up faults are not the point
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    _measure("raw", 400, 1 << 20, keep)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 400)
"""


def _receiver_faults_per_message(tmp_path, setting: str) -> float:
    script = tmp_path / "receiver.py"
    script.write_text(_RECEIVER)
    result = subprocess.run(
        [sys.executable, str(script), setting], capture_output=True, text=True, timeout=120, check=True
    )
    return float(result.stdout.split()[-1])


@pytest.mark.skipif(not memory._is_glibc_malloc(), reason="the settings exist only in glibc's own malloc")
def test_kept_buffers_spare_the_receiver_a_page_fault_per_page_of_each_message(tmp_path) -> None:
    # With glibc's defaults the receiving process hands message buffers back to the kernel and
    # faults fresh pages in for the next messages (a 1 MiB message is 256 pages); with the
    # settings, freed buffers are reused.
    default = _receiver_faults_per_message(tmp_path, "default")
    kept = _receiver_faults_per_message(tmp_path, "keep")
    # Measured on the 2-core machine: 17-88 faults per message with the defaults, 0-8 kept.
    assert default > 4 * kept, f"{default} page faults per message with glibc's defaults, {kept} kept"


def test_other_c_libraries_and_preloaded_allocators_are_left_alone(monkeypatch) -> None:
    monkeypatch.setattr(memory, "_applied", False)
    monkeypatch.setattr(memory.os, "confstr", lambda name: None)  # not glibc (musl has no such name)
    assert memory.keep_freed_message_memory() is False
    monkeypatch.setattr(memory.os, "confstr", lambda name: "glibc 2.36")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert memory.keep_freed_message_memory() is False
    assert memory._applied is False
