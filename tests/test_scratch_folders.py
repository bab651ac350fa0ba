"""Worker processes' scratch folders (their TMPDIR): deleted once the worker has ended, however it
ended, and by a janitor when the parent that made them is killed too (a Ray host's SIGKILL)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from longhorizon.launch.launchers.supervise import SubprocessControl

# A worker that makes a temporary folder the usual way, fills it, says where, and waits.
WORKER = r"""
import pathlib, sys, tempfile, time
folder = pathlib.Path(tempfile.mkdtemp(prefix="engine-weights-"))
(folder / "model.safetensors").write_bytes(b"w" * 1000)
print(folder, flush=True)
time.sleep(120)
"""


def _wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {timeout_s}s"
        time.sleep(0.05)


class _Worker(SubprocessControl):
    """The parent's side, as the local launcher's children and the Ray hosts have it."""

    def start(self) -> Path:
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True,
            env={**os.environ, **self.scratch_environment("actor-0")},
        )
        return Path(self.process.stdout.readline().strip())


def test_a_killed_workers_temporary_folders_go_when_it_restarts_and_when_it_stops():
    worker = _Worker()
    try:
        made = worker.start()
        first_scratch = worker.scratch_dir
        assert made.parent == first_scratch and (made / "model.safetensors").is_file()
        worker.process.kill()  # SIGKILL: the worker deletes nothing
        worker.process.wait()
        worker.process.stdout.close()
        assert made.is_dir()
        made_again = worker.start()  # the launcher restarts it
        assert not first_scratch.exists()
        assert made_again.is_dir() and worker.scratch_dir != first_scratch
        worker.terminate()
        assert worker.wait(timeout=30)
        assert not made_again.exists() and worker.scratch_dir is None
    finally:
        worker.kill()
        worker.wait(timeout=30)
        if worker.process is not None:
            worker.process.stdout.close()


# A Ray host: a parent that starts a worker (which dies with it, as launch/worker.py arranges).
HOST = r"""
import os, signal, subprocess, sys
from longhorizon.launch.launchers.supervise import SubprocessControl

worker_code = (
    "import os, signal, time; from longhorizon.common.processes import die_with_parent; "
    f"die_with_parent(signal.SIGTERM, parent_pid={os.getpid()}); time.sleep(120)"
)
host = SubprocessControl()
host.process = subprocess.Popen([sys.executable, "-c", worker_code], env={**os.environ, **host.scratch_environment("actor-1")})
(host.scratch_dir / "left-by-the-worker").write_text("x")
print(host.scratch_dir, host.process.pid, flush=True)
sys.stdin.readline()  # until the test kills this process
"""


def test_the_scratch_folder_goes_when_its_parent_is_killed_too():
    host = subprocess.Popen([sys.executable, "-c", HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    worker_pid = None
    try:
        scratch, worker_pid = host.stdout.readline().split()
        assert Path(scratch).is_dir()
        host.kill()
        host.wait(timeout=30)
        _wait_until(lambda: not Path(scratch).exists(), "the scratch folder deleted by the host's janitor")
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
        if worker_pid is not None:
            try:
                os.kill(int(worker_pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        host.stdin.close()
        host.stdout.close()


# A worker whose own child stays in its process group and outlives it, as vLLM's engine
# processes outlive an actor killed with SIGKILL.
SPAWNER = r"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
child.wait()
"""


def test_what_a_killed_worker_left_in_its_process_group_is_ended_with_it():
    worker = SubprocessControl()
    for restart in (False, True):
        worker.process = subprocess.Popen([sys.executable, "-c", SPAWNER], stdout=subprocess.PIPE, text=True,
                                          start_new_session=True,
                                          env={**os.environ, **worker.scratch_environment("actor-0")})
        child = int(worker.process.stdout.readline())
        worker.process.stdout.close()
        os.kill(worker.process.pid, signal.SIGKILL)
        worker.process.wait()
        assert _state(child) not in (None, "Z")  # orphaned, still running
        if restart:  # the launcher's next start ends it
            worker.scratch_environment("actor-0")
        else:  # as does the launcher's wait for the worker
            assert worker.wait(timeout=30)
        _wait_until(lambda: _state(child) in (None, "Z"), "the orphan ended")
    worker.wait(timeout=30)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None
