"""No helper outlives its owner: web app servers, the Python sandbox, the ScienceWorld JVM, Chromium.

Each owner test starts a real owner process (this interpreter running OWNER_SCRIPT), which starts
helpers through our own APIs; the test records every descendant of the owner, kills the owner
(SIGKILL, or SIGTERM, where no Python cleanup runs either) and requires every recorded process to
be gone within DEADLINE_S. The TiedProcess and die_with_parent tests check the mechanisms alone.
"""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from longhorizon.common.processes import TiedProcess

DEADLINE_S = 15.0
STARTUP_S = 120.0  # the first start of Fossil or DokuWiki builds a cached snapshot

OWNER_SCRIPT = r'''
import signal, subprocess, sys, threading, time

mode = sys.argv[1]
if mode == "tied":
    from longhorizon.common.processes import TiedProcess

    handles = []
    # Started from a thread that then exits: the tie must not depend on the starting thread.
    starter = threading.Thread(target=lambda: handles.append(TiedProcess(["sh", "-c", "s=300; sleep $s & sleep $s & wait"])))
    starter.start()
    starter.join()
elif mode == "daemon":
    from longhorizon.common.processes import TiedProcess

    # The subshell starts a sleep in a session of its own and exits: the sleep is an orphan
    # outside the helper's process group, as Fossil's backoffice process is.
    helper = TiedProcess(["sh", "-c", "s=300; (setsid sleep $s &); sleep $s"])
elif mode == "pdeathsig":
    from longhorizon.common.processes import die_with_parent

    helper = subprocess.Popen(["sleep", "300"], preexec_fn=lambda: die_with_parent(signal.SIGKILL))
elif mode == "sites":
    from longhorizon.envs.web.apps.dokuwiki import DokuWikiSite
    from longhorizon.envs.web.apps.fossil import FossilSite
    from longhorizon.envs.web.apps.shop import ShopSite

    sites = [ShopSite(), FossilSite(), DokuWikiSite()]
    for site in sites:
        site.start()
elif mode == "sandbox":
    from longhorizon.envs.search.pytool import PythonLimits, run_python

    # The search env runs the tool in a worker thread; the snippet sleeps until its owner dies.
    limits = PythonLimits(cpu_seconds=60, wall_seconds=300)
    threading.Thread(target=run_python, args=("import time\ntime.sleep(300)", limits), daemon=True).start()
elif mode == "sciworld":
    import trio
    from longhorizon.envs.base import Task
    from longhorizon.envs.sciworld.env import SciWorldEnv

    env = SciWorldEnv()
    task = Task(env_name="sciworld", task_id="train-find-non-living-thing-0", split="train",
                category="find-non-living-thing", data={"task_name": "find-non-living-thing", "variation": 0})
    trio.run(env.reset, task)
elif mode == "chromium":
    import trio
    from longhorizon.envs.web.browser import BrowserPool

    pool = BrowserPool(1)
    session = trio.run(pool.open_session, ["http://127.0.0.1:9"])  # a context and a tab: renderers run
print("ready", flush=True)
time.sleep(600)  # until the test kills this process
'''


def start_owner(tmp_path: Path, mode: str) -> subprocess.Popen:
    script = tmp_path / "owner.py"
    script.write_text(OWNER_SCRIPT)
    return subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)


def wait_until_ready(owner: subprocess.Popen) -> None:
    assert owner.stdout is not None
    ready, _, _ = select.select([owner.stdout], [], [], STARTUP_S)
    line = owner.stdout.readline() if ready else b""
    assert line.strip() == b"ready", f"the owner did not get ready (exit code {owner.poll()}, said {line!r})"


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return "(gone)"


def describe(process: psutil.Process) -> str:
    return f"{process.pid} {command_line(process)[:160]}"


def wait_for_helpers(owner: subprocess.Popen, expected: list[str]) -> list[psutil.Process]:
    """The owner's descendants once each expected text appears in the command lines of as many
    descendants as it appears in `expected`."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        helpers = descendants(owner.pid)
        lines = [command_line(helper) for helper in helpers]
        missing = [text for text in set(expected) if sum(text in line for line in lines) < expected.count(text)]
        if not missing:
            return helpers
        assert time.monotonic() < deadline, f"helpers {missing} never appeared; running: {list(map(describe, helpers))}"
        time.sleep(0.1)


def alive(process: psutil.Process) -> bool:
    # A zombie has exited; it only waits for whoever inherited it to collect its status.
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def survivors_after(helpers: list[psutil.Process], deadline_s: float = DEADLINE_S) -> list[psutil.Process]:
    """The helpers still running when all are gone or the deadline passes, whichever comes first."""
    deadline = time.monotonic() + deadline_s
    while True:
        left = [helper for helper in helpers if alive(helper)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def kill_owner_and_check(tmp_path: Path, mode: str, expected: list[str], signum: int = signal.SIGKILL) -> None:
    owner = start_owner(tmp_path, mode)
    helpers: list[psutil.Process] = []
    try:
        wait_until_ready(owner)
        helpers = wait_for_helpers(owner, expected)
        owner.send_signal(signum)
        assert owner.wait(timeout=DEADLINE_S) == -signum  # no handler ran: no cleanup code either
        left = survivors_after(helpers)
        assert not left, f"{len(left)} of {len(helpers)} helpers outlived their owner: {[describe(p) for p in left]}"
    finally:
        # Whatever the outcome, leave nothing of ours behind.
        for process in [*helpers, *descendants(owner.pid)]:
            try:
                process.kill()
            except psutil.Error:
                pass
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()


# -- the mechanisms ----------------------------------------------------------------------------------


def test_tied_process_reports_the_helpers_exit_status():
    assert TiedProcess([sys.executable, "-c", "raise SystemExit(3)"]).wait(timeout=DEADLINE_S) == 3
    # A helper killed by a signal reads as killed by that signal, as a plain Popen would report it.
    assert TiedProcess(["sh", "-c", "kill -XCPU $$"]).wait(timeout=DEADLINE_S) == -signal.SIGXCPU
    with pytest.raises(FileNotFoundError):
        TiedProcess(["no-such-program-longhorizon"])
    with pytest.raises(TypeError):
        TiedProcess(["true"], start_new_session=False)


def test_tied_process_kill_ends_everything_the_helper_started():
    process = TiedProcess(["sh", "-c", "s=300; sleep $s & sleep $s & wait"])
    deadline = time.monotonic() + DEADLINE_S
    while sum("sleep 300" in command_line(child) for child in descendants(process.pid)) < 2:
        assert time.monotonic() < deadline, "the helper's children never appeared"
        time.sleep(0.05)
    helpers = descendants(process.pid)
    process.kill()  # the whole process group, not only the watchdog
    assert process.wait(timeout=DEADLINE_S) == -signal.SIGKILL
    assert not survivors_after(helpers)


def test_tied_process_started_from_a_finished_thread_lives_until_stopped():
    # With PR_SET_PDEATHSIG this helper would die when the starting thread exits.
    handles: list[TiedProcess] = []
    starter = threading.Thread(target=lambda: handles.append(TiedProcess(["sleep", "300"])))
    starter.start()
    starter.join()
    process = handles[0]
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(timeout=1.0)  # still running a second after its starting thread ended
    finally:
        process.terminate()
    assert process.wait(timeout=DEADLINE_S) == -signal.SIGTERM


def test_tied_process_ends_what_its_helper_left_running():
    # The subshell prints the pid of a sleep it started in a new session, then everything but
    # that sleep exits.
    process = TiedProcess(["sh", "-c", "(setsid sleep 300 & echo $!)"], stdout=subprocess.PIPE)
    stray = psutil.Process(int(process.stdout.readline()))
    process.stdout.close()
    assert process.wait(timeout=DEADLINE_S) == 0
    assert not survivors_after([stray])


def test_tied_helpers_end_when_their_owner_is_killed(tmp_path):
    # (The shell spells the sleeps "sleep $s", so only the sleeps themselves match.)
    kill_owner_and_check(tmp_path, "tied", ["sleep 300", "sleep 300"])


def test_a_helpers_daemon_ends_when_the_owner_is_killed(tmp_path):
    kill_owner_and_check(tmp_path, "daemon", ["sleep 300", "sleep 300"])


def test_die_with_parent_ends_a_child_when_its_parent_is_killed(tmp_path):
    kill_owner_and_check(tmp_path, "pdeathsig", ["sleep 300"])


# -- the helpers the envs start ------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_web_app_servers_end_with_their_owner(tmp_path, signum):
    kill_owner_and_check(tmp_path, "sites", ["php", "fossil", "shop_server"], signum)


def test_python_sandbox_ends_with_its_owner(tmp_path):
    kill_owner_and_check(tmp_path, "sandbox", ["snippet.py"])


def test_sciworld_jvm_ends_with_its_owner(tmp_path):
    # py4j starts the JVM with --die-on-broken-pipe: it exits when its stdin pipe from us closes.
    kill_owner_and_check(tmp_path, "sciworld", ["java"])


@pytest.mark.browser
def test_chromium_ends_with_its_owner(tmp_path):
    # Playwright's node driver exits when its stdin pipe from us closes, and Chromium exits when
    # its DevTools pipe from the driver closes.
    kill_owner_and_check(tmp_path, "chromium", ["playwright", "chromium", "--type=renderer"])
