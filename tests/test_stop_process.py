"""`stop_process`: SIGTERM first, SIGKILL for a child that outlives its grace, a finished child reaped."""

import signal
import subprocess
import sys

from longhorizon.common.processes import stop_process

_IGNORES_SIGTERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
_SLEEPS = "print('ready', flush=True); import time; time.sleep(60)"


def _start(code: str) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"  # its signal handling is in place
    return process


def test_a_child_that_stops_on_sigterm_gets_nothing_more():
    process = _start(_SLEEPS)
    assert stop_process(process, timeout_s=30) == -signal.SIGTERM


def test_a_child_that_ignores_sigterm_is_killed_after_its_grace():
    process = _start(_IGNORES_SIGTERM)
    assert stop_process(process, timeout_s=0.5) == -signal.SIGKILL
    assert process.poll() == -signal.SIGKILL


def test_a_child_that_has_exited_is_only_reaped():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    assert stop_process(process, timeout_s=0.5) == 3
