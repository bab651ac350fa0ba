"""A recipe's phase in a process of its own: its result, its notes and its errors reach the parent."""

from __future__ import annotations

import os
import signal

import pytest

from longhorizon.launch.child import ChildPhaseError, run_in_child


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


def test_the_result_and_notes_come_back_from_another_process():
    notes = []
    result = run_in_child(_phase, 21, note=notes.append, scale=2)
    assert result["value"] == 42 and result["pid"] != os.getpid()
    assert notes == ["working on 21", "done"]


def test_an_error_in_the_phase_is_raised_in_the_parent_after_its_notes():
    notes = []
    with pytest.raises(ValueError, match="must be > 0"):
        run_in_child(_failing_phase, note=notes.append)
    assert notes == ["about to fail"]


def test_a_killed_phase_says_how_it_ended():
    with pytest.raises(ChildPhaseError, match="exit code -9"):
        run_in_child(_killed_phase)


def test_the_progress_bar_writes_to_the_childs_stderr():
    import sys

    assert run_in_child(_progress_phase, progress_stream=sys.stderr) is True
