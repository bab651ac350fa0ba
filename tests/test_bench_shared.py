"""What the benchmarks share: the table printer and the memory figures (launch/bench/)."""

import mmap
import subprocess
import sys
import time

from longhorizon.launch.bench.memory import MIB, PeakRss, memory_use
from longhorizon.launch.bench.tables import Column, print_json, print_table


def test_a_table_aligns_labels_left_and_values_right_then_json_is_the_last_line(capsys):
    print_table(
        [Column("mode", 6, left=True), Column("episodes/s", 11, ".2f"), Column("bytes", 7, ","), Column("note", 4)],
        [["async", 12.345, 1234567, None], ["sync", 3.0, 5, "ok"]],
    )
    print_json({"b": 1, "a": [2]})
    assert capsys.readouterr().out.splitlines() == [
        "mode    episodes/s   bytes note",
        "async        12.35 1,234,567 None",  # a cell wider than its column is written whole
        "sync          3.00       5   ok",
        '{"a": [2], "b": 1}',
    ]


def test_a_table_with_an_indent_and_its_own_separator(capsys):
    print_table([Column("n", 3), Column("x", 4, ".1f")], [[7, 1.5]], separator="  ", indent="> ")
    assert capsys.readouterr().out.splitlines() == [">   n     x", ">   7   1.5"]


def test_memory_of_this_process_of_its_children_and_of_one_that_ended():
    own = memory_use()
    assert own.processes == 1 and own.rss_bytes > 10 * MIB and own.pss_bytes is None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        family = memory_use(children=True, detailed=True)
        assert family.processes >= 2 and family.rss_bytes > own.rss_bytes
        assert 0 < family.uss_bytes <= family.pss_bytes <= family.rss_bytes
    finally:
        child.kill()
        child.wait()
    gone = memory_use([child.pid])
    assert (gone.processes, gone.rss_bytes) == (0, 0)


def test_peak_rss_sees_memory_held_only_inside_the_block():
    """The block's memory is gone by the end of the `with`, so only a sample taken inside it can
    show it. The block is mapped from the kernel directly: from malloc it could reuse pages that
    are already resident (a process that keeps freed message buffers, as `bench weights` makes the
    suite's worker, holds up to 128 MiB of them), and the resident size would not move."""
    with PeakRss(interval_s=0.01) as memory:
        block = mmap.mmap(-1, 64 * MIB)
        for offset in range(0, len(block), 4096):  # touch every page so it becomes resident
            block[offset] = 1
        deadline = time.monotonic() + 60  # the sampling thread's turn, later on a loaded machine
        while memory.peak_bytes - memory.start_bytes <= 32 * MIB and time.monotonic() < deadline:
            time.sleep(0.01)
        block.close()
    assert memory.added_mb > 32
