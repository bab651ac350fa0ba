"""Where the suite's CPU goes: a pytest plugin that records, per test, its wall time and the CPU
time of the test process and of the child processes it reaped, and writes them to a TSV file.

Enable it with `-p tests.cpu_times` (CPU_TIMES_FILE names the file, cpu_times.tsv by default; a
worker of pytest-xdist appends its id to the name). Times cover setup, call and teardown, so a
test that starts a module's shared fixture carries its cost. A child counts only once it is
reaped: one left running past its test's teardown is charged to whichever later test reaps it.
"""

import os
import resource
import time
from pathlib import Path

import pytest

COLUMNS = ["nodeid", "outcome", "wall_s", "cpu_self_s", "cpu_children_s", "cpu_total_s"]


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class CpuTimes:
    """Per-test deltas of wall clock and of user+system CPU, this process and its reaped children."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: list[list] = []
        # Also read in the xdist controller, which sees every report but runs no test.
        self.outcome = "passed"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        wall = time.perf_counter()
        own = _cpu_seconds(resource.RUSAGE_SELF)
        children = _cpu_seconds(resource.RUSAGE_CHILDREN)
        self.outcome = "passed"
        yield
        own = _cpu_seconds(resource.RUSAGE_SELF) - own
        children = _cpu_seconds(resource.RUSAGE_CHILDREN) - children
        self.rows.append([item.nodeid, self.outcome, time.perf_counter() - wall, own, children, own + children])
        self._write()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        if report.outcome != "passed" and self.outcome == "passed":
            self.outcome = f"{report.when} {report.outcome}"

    def _write(self):
        # Rewritten after each test, so a run stopped half-way still leaves what it measured.
        lines = ["\t".join(COLUMNS)]
        for row in self.rows:
            lines.append("\t".join([row[0], row[1], *(f"{value:.2f}" for value in row[2:])]))
        self.path.write_text("\n".join(lines) + "\n")


def pytest_configure(config):
    path = Path(os.environ.get("CPU_TIMES_FILE", "cpu_times.tsv"))
    worker = getattr(config, "workerinput", {}).get("workerid")
    if worker:
        path = path.with_name(f"{path.stem}-{worker}{path.suffix}")
    config.pluginmanager.register(CpuTimes(path), "cpu_times_recorder")
