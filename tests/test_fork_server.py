"""The fork server the local launcher starts workers from (launch/launchers/fork_server.py).

Each test starts a real server (preloading only small modules, so it is up in a fraction of a
second) and forks children that run the entry points below instead of the worker's main: they
report what they were given, wait for a signal, or exit with a code.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from longhorizon.launch.launchers.fork_server import ForkServer, ForkServerError, fork_server_supported

pytestmark = pytest.mark.skipif(not fork_server_supported(), reason="the fork server needs Linux pidfds (5.3 or later)")

HERE = "tests.test_fork_server"


def describe_and_exit(argv: list[str]) -> None:
    """An entry point: what the child was given, as one JSON line on stdout, a line on stderr, then
    exit with the code in argv[0]."""
    import tempfile

    import numpy

    print(json.dumps({
        "argv": argv, "environment": dict(os.environ), "cwd": os.getcwd(), "tmp": tempfile.gettempdir(),
        "session_leader": os.getsid(0) == os.getpid(), "name": Path("/proc/self/comm").read_text().strip(),
        "stdin": os.read(0, 10).decode(), "random": float(numpy.random.rand()),
        "path0": sys.path[0], "argv0": sys.argv[0],
    }), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    sys.exit(int(argv[0]))


def sleep_until_signalled(argv: list[str]) -> None:
    print("sleeping", flush=True)
    time.sleep(120)


def _wait_for(predicate, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.fixture
def server():
    forks = ForkServer(preload=["numpy", HERE])
    yield forks
    forks.close()


def test_a_child_gets_its_arguments_environment_folder_files_and_name(server, tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.chdir(tmp_path)
    log_path = tmp_path / "worker.log"
    with log_path.open("ab") as log_file:
        child = server.spawn(["7", "x"], env={"ONLY": "this", "TMPDIR": str(scratch)}, log_file=log_file,
                             name="lh-actor-12-and-more", entry=f"{HERE}:describe_and_exit")
    assert child.wait(timeout=30) == 7 and child.returncode == 7 and child.poll() == 7
    lines = log_path.read_text().splitlines()
    seen = json.loads(lines[0])
    assert lines[1] == "to stderr"
    assert seen["argv"] == ["7", "x"]
    assert seen["environment"] == {"ONLY": "this", "TMPDIR": str(scratch)}  # nothing of the launcher's
    assert seen["tmp"] == str(scratch)  # tempfile asks TMPDIR again
    assert seen["cwd"] == str(tmp_path) and seen["path0"] == str(tmp_path)
    assert seen["argv0"].endswith("test_fork_server.py")
    assert seen["session_leader"]
    assert seen["name"] == "lh-actor-12-and"  # the kernel keeps 15 bytes
    assert seen["stdin"] == ""


def test_children_draw_different_random_numbers(server, tmp_path):
    """The server imported numpy; its global random state must still differ between children (it
    seeds itself again after a fork), as between fresh processes."""
    draws = []
    for index in range(2):
        log_path = tmp_path / f"{index}.log"
        with log_path.open("ab") as log_file:
            child = server.spawn(["0"], env={}, log_file=log_file, name="x", entry=f"{HERE}:describe_and_exit")
        assert child.wait(timeout=30) == 0
        draws.append(json.loads(log_path.read_text().splitlines()[0])["random"])
    assert draws[0] != draws[1]


def test_signals_reach_the_child_and_its_end_is_reported_as_popen_would(server, tmp_path):
    with (tmp_path / "log").open("ab") as log_file:
        terminated = server.spawn([], env={}, log_file=log_file, name="a", entry=f"{HERE}:sleep_until_signalled")
        killed = server.spawn([], env={}, log_file=log_file, name="b", entry=f"{HERE}:sleep_until_signalled")
    _wait_for(lambda: (tmp_path / "log").read_text().count("sleeping") == 2, what="both children")
    assert terminated.poll() is None and killed.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        killed.wait(timeout=0.2)
    terminated.terminate()
    killed.kill()
    assert terminated.wait(timeout=10) == -signal.SIGTERM
    assert killed.wait(timeout=10) == -signal.SIGKILL
    killed.kill()  # ended: a no-op, not an error


LAUNCHER_SCRIPT = textwrap.dedent("""
    import sys, time
    from longhorizon.launch.launchers.fork_server import ForkServer
    server = ForkServer(preload=["tests.test_fork_server"])
    with open(sys.argv[1], "ab") as log_file:
        child = server.spawn([], env={}, log_file=log_file, name="w", entry="tests.test_fork_server:sleep_until_signalled")
    print(server.process.pid, child.pid, flush=True)
    time.sleep(120)
""")


def test_a_killed_launcher_takes_the_server_and_its_children_with_it(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER_SCRIPT, str(tmp_path / "log")],
                                stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    try:
        server_pid, child_pid = map(int, launcher.stdout.readline().split())
        assert _alive(server_pid) and _alive(child_pid)
        launcher.kill()
        launcher.wait()
        _wait_for(lambda: not _alive(server_pid) and not _alive(child_pid), what="the server and its child to end")
    finally:
        launcher.kill()
        launcher.wait()


def test_a_killed_server_ends_its_children_and_later_starts_are_refused(tmp_path):
    server = ForkServer(preload=[HERE])
    try:
        with (tmp_path / "log").open("ab") as log_file:
            child = server.spawn([], env={}, log_file=log_file, name="w", entry=f"{HERE}:sleep_until_signalled")
            server.process.kill()
            # The child learns of it from the kernel (SIGTERM); nobody is left to tell its code.
            assert child.wait(timeout=10) == -signal.SIGKILL
            assert not _alive(child.pid)
            with pytest.raises(ForkServerError):
                server.spawn([], env={}, log_file=log_file, name="w", entry=f"{HERE}:sleep_until_signalled")
            assert not server.alive
    finally:
        server.close()


def test_a_worker_process_falls_back_to_a_fresh_interpreter_when_the_server_is_gone(tmp_path):
    from longhorizon.launch.launchers.local import WorkerProcess

    server = ForkServer(preload=[])
    server.close()
    worker = WorkerProcess("actor", 0, tmp_path / "no-such-config.toml", tmp_path / "actor-0.log",
                           fork_server=lambda: server)
    worker.start()
    assert isinstance(worker.process, subprocess.Popen)
    assert worker.wait(timeout=60) and worker.poll() == 2  # the worker's own refusal of a missing config
    log = (tmp_path / "actor-0.log").read_text()
    assert "the fork server has ended; starting actor-0 as a new process" in log
    assert "no-such-config.toml" in log


def test_a_shared_server_serves_later_runs_until_an_import_time_variable_changes_or_it_dies(monkeypatch, tmp_path):
    from longhorizon.launch.launchers import fork_server

    monkeypatch.setattr(fork_server, "_shared", {})
    monkeypatch.setattr(fork_server, "BASE_PRELOAD", (HERE,))  # up in a moment: little to import
    monkeypatch.delenv("HF_HOME", raising=False)
    started = []
    try:
        first = fork_server.shared_fork_server()
        started.append(first)
        assert fork_server.shared_fork_server() is first
        monkeypatch.setenv("SOMETHING_ELSE", "read after start-up, given to each worker")
        assert fork_server.shared_fork_server() is first

        monkeypatch.setenv("HF_HOME", "/elsewhere")  # read by huggingface_hub as it is imported
        other = fork_server.shared_fork_server()
        started.append(other)
        assert other is not first and other.alive
        assert not first.alive  # it had no worker running: not kept
        with (tmp_path / "log").open("ab") as log_file:
            worker = other.spawn([], env={}, log_file=log_file, name="w", entry=f"{HERE}:sleep_until_signalled")

        monkeypatch.delenv("HF_HOME")
        third = fork_server.shared_fork_server()
        started.append(third)
        assert third.alive and other.alive  # its worker still runs: kept
        monkeypatch.setenv("HF_HOME", "/elsewhere")
        assert fork_server.shared_fork_server() is other

        worker.kill()
        worker.wait(timeout=10)
        other.process.kill()
        other.process.wait()
        replacement = fork_server.shared_fork_server()
        started.append(replacement)
        assert replacement is not other and replacement.alive
    finally:
        for server in started:
            server.close()
