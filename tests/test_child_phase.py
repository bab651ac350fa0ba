"""A recipe's phase in a process of its own: its result, its notes and its errors reach the parent."""

from __future__ import annotations

import os
import signal

import pytest

from longhorizon.launch.recipes.child import ChildPhaseError, run_in_child


def _phase(value, *, note, scale=1):
    note(f"working on {value}")
    note("done")
    return {"pid": os.getpid(), "value": value * scale}


def _failing_phase(*, note):
    note("about to fail")
    raise ValueError("sft.learning_rate must be > 0, got -1")


def _killed_phase():
    os.kill(os.getpid(), signal.SIGKILL)


def _progress_phase(*, progress_stream):
    return progress_stream.fileno() == 2


@pytest.fixture(params=["forked", "spawned"])
def start(request, monkeypatch):
    """Each path a phase's process can take: forked by the fork server, or spawned where there is
    none."""
    from longhorizon.launch.recipes import child

    if request.param == "spawned":
        monkeypatch.setattr(child, "fork_server_supported", lambda: False)
    return request.param


def test_the_result_and_notes_come_back_from_another_process(start):
    notes = []
    result = run_in_child(_phase, 21, note=notes.append, scale=2)
    assert result["value"] == 42 and result["pid"] != os.getpid()
    assert notes == ["working on 21", "done"]


def test_an_error_in_the_phase_is_raised_in_the_parent_after_its_notes():
    notes = []
    with pytest.raises(ValueError, match="must be > 0"):
        run_in_child(_failing_phase, note=notes.append)
    assert notes == ["about to fail"]


def test_a_killed_phase_says_how_it_ended(start):
    with pytest.raises(ChildPhaseError, match="exit code -9"):
        run_in_child(_killed_phase)


def test_the_progress_bar_writes_to_the_childs_stderr():
    import sys

    assert run_in_child(_progress_phase, progress_stream=sys.stderr) is True


def _phase_processes_of(parent_pid: int) -> list[int]:
    """The pids of the phase processes `parent_pid` started: forked by its fork server (named
    `lh-<phase>`) or spawned (not multiprocessing's resource tracker)."""
    from pathlib import Path

    parents, names, commands = {}, {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        name, fields = stat.split(" (", 1)[1].rsplit(")", 1)
        parents[int(entry.name)], names[int(entry.name)] = int(fields.split()[1]), name
    descendants, frontier = set(), {parent_pid}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - descendants
        descendants |= frontier
    return [pid for pid in descendants
            if names[pid].startswith("lh-") or (parents[pid] == parent_pid and b"spawn_main" in commands[pid])]


def _ended(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # exited, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the phase's process in /proc (Linux)")
def test_the_phase_ends_when_the_process_that_runs_it_is_killed():
    """A SIGKILLed (or SIGTERMed) experiment runs no cleanup; its phase must not train on alone."""
    import subprocess
    import sys
    import time

    code = "import time; from longhorizon.launch.recipes.child import run_in_child; run_in_child(time.sleep, 600)"
    parent = subprocess.Popen([sys.executable, "-c", code])
    phases = []
    try:
        deadline = time.monotonic() + 60
        while not phases and time.monotonic() < deadline:
            time.sleep(0.2)
            phases = _phase_processes_of(parent.pid)
        assert len(phases) == 1, "the phase's process did not start"
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while not _ended(phases[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _ended(phases[0]), "the phase outlived the process that started it"
    finally:
        parent.kill()
        parent.wait()
        for pid in phases:
            if not _ended(pid):
                os.kill(pid, signal.SIGKILL)
