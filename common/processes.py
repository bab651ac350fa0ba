"""Child-process hygiene: helper processes that end when the process that started them ends.

An actor starts helpers (web app servers, the search env's Python sandbox). When the actor is
killed with SIGKILL no Python code runs (no atexit, no finally), so a helper must learn by itself
that its owner is gone. This module offers two tools.

`die_with_parent(signum)` asks Linux (prctl PR_SET_PDEATHSIG) to send `signum` to the calling
process when its parent dies. A worker process calls it first thing (launch/worker.py); it also
works as a `preexec_fn`. Three limits make it unfit for helpers started by an actor:
- the kernel sends the signal when the *thread* that forked the child exits, not the process, so a
  child started from a trio or asyncio worker thread would be killed as soon as that thread is
  retired (trio ends a worker thread after 10 s without work);
- it is not inherited by the child's own children, so php's workers or fossil's per-connection
  forks survive when only the server is signalled;
- a `preexec_fn` is unsafe in a process that runs threads (the forked child may wait forever on a
  lock another thread held), and actors run several.

`TiedProcess` therefore uses a lifeline pipe and a watchdog. The owner creates a pipe and keeps
its write end (close-on-exec, so no program it starts inherits it). A watchdog, this module run as
a script by `python -I -S` (standard library only; about 50 ms to start), holds the read end,
starts the helper as its child and waits for the helper's exit or the end of the pipe, whichever
comes first. The kernel closes the owner's write end however the owner exits and whichever thread
started the helper; the watchdog then reads end-of-file and ends every descendant: SIGTERM, then
SIGKILL after a grace period. The watchdog is a child subreaper (PR_SET_CHILD_SUBREAPER), so a
descendant whose parent exits is re-parented to it instead of init: it finds all of them in /proc,
even a daemon that left the process group with setsid (Fossil's backoffice does). When the helper
exits by itself, the watchdog ends what the helper left running and exits with the helper's status.
If the watchdog itself is killed, the helper gets SIGKILL through PR_SET_PDEATHSIG, which the
watchdog sets in its single-threaded child before exec, where that is safe.
The owner's handle is the watchdog's: its pid is the id of the new session and process group the
watchdog leads (the helper stays in that group), `send_signal`, `terminate` and `kill` signal the
whole group, and its exit status is the helper's.

Limits: a process that forks without exec (multiprocessing's "fork" start method) inherits the
write end, and the helpers then live until that fork exits too; a handle dropped while its helper
runs keeps the helper until the owner exits (subprocess keeps running children's handles alive),
so stop helpers explicitly; `kill()` (SIGKILL to the group) gives the watchdog no chance to end
descendants that left the group.

Working folders need the same care: a web app server works in a folder under /tmp that its owner
deletes when it stops the server, and a SIGKILLed owner deletes nothing. `tied_folder(prefix)`
makes such a folder and hands its path to the owner's janitor: one more process of this script
(`--janitor`), started on first use, one per owner process, in a session of its own so signals
meant for the owner's process group do not reach it. The owner tells it over another lifeline
pipe which folders to delete ("+path") and which it has deleted itself ("-path"); at end of file
the janitor deletes what is left, retrying for a while because a helper that is still being
stopped may be writing in its folder. A folder is therefore covered from its creation on, also
while no helper runs in it. `remove_tied_folder(path)` deletes one now. If the janitor itself is
killed, the next call starts a new one and hands it every folder still registered.

Helpers we do not start ourselves already hang on such a pipe: Playwright's node driver exits when
its stdin pipe from Python closes and Chromium exits when its DevTools pipe from the driver closes;
py4j starts ScienceWorld's JVM with --die-on-broken-pipe, so it exits when its stdin closes.
tests/test_orphans.py checks all of them by killing an owner process.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36
DEFAULT_GRACE_S = 2.0
"""Seconds a helper gets between SIGTERM and SIGKILL after its owner died."""


def _find_prctl() -> Any:
    """libc's prctl, or None off Linux. Looked up at import: a preexec_fn must not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_prctl = _find_prctl()


def die_with_parent(signum: int = signal.SIGTERM, *, parent_pid: int | None = None) -> None:
    """Have the kernel send `signum` to this process when its parent (the forking thread) dies.

    A no-op off Linux. `parent_pid`, when given, closes a race: if the parent died before the
    request took effect (the process was already re-parented), the signal is sent at once.
    Usable as a preexec_fn only in a single-threaded parent (see the module docstring).
    """
    if _prctl is None:
        return
    _prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signum)


def set_process_name(name: str) -> None:
    """Name the calling thread (the main thread: the process) as `ps -o comm` and `top` show it;
    15 bytes at most are kept. A no-op off Linux."""
    if _prctl is None:
        return
    import ctypes

    _prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


class TiedProcess(subprocess.Popen):
    """A helper command run under a watchdog that ends it, and all it started, when this process dies.

    Takes Popen's keyword arguments (stdin, stdout, stderr, cwd, env, ...) except those that choose
    the session or run code before exec: the helper always gets a new session, led by the watchdog.
    `pid` is the watchdog's, which is also the id of the process group the helper runs in.
    """

    def __init__(self, args: Sequence[str], *, grace_s: float = DEFAULT_GRACE_S, **popen_kwargs: Any) -> None:
        if isinstance(args, (str, bytes)) or not args:
            raise TypeError("TiedProcess needs the command as a non-empty list of arguments")
        for forbidden in ("start_new_session", "process_group", "preexec_fn", "shell"):
            if forbidden in popen_kwargs:
                raise TypeError(f"TiedProcess chooses {forbidden} itself")
        command = [os.fspath(part) for part in args]
        if not os.path.dirname(command[0]):
            # Look a bare program name up here so a missing one raises FileNotFoundError in the
            # caller, as Popen does, rather than failing only in the watchdog's output.
            import shutil  # here, not at the top: the watchdog runs this module and needs no shutil

            environment = popen_kwargs.get("env")
            search_path = (environment if environment is not None else os.environ).get("PATH", os.defpath)
            program = shutil.which(command[0], path=search_path)
            if program is None:
                raise FileNotFoundError(f"no such program: {command[0]!r}")
            command[0] = program
        read_end, write_end = os.pipe()  # both close-on-exec: only pass_fds hands one on
        self._lifeline: int | None = write_end
        self._lifeline_lock = threading.Lock()
        try:
            super().__init__(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), str(read_end), repr(float(grace_s)), "--",
                 *command],
                start_new_session=True,
                pass_fds=(read_end, *popen_kwargs.pop("pass_fds", ())),
                **popen_kwargs,
            )
        except BaseException:
            self._close_lifeline()
            raise
        finally:
            os.close(read_end)

    def send_signal(self, sig: int) -> None:
        """Signal the helper's whole process group (it includes the watchdog, which passes SIGTERM on)."""
        if self.poll() is not None:
            return
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def poll(self) -> int | None:
        code = super().poll()
        if code is not None:
            self._close_lifeline()
        return code

    def wait(self, timeout: float | None = None) -> int:
        code = super().wait(timeout)
        self._close_lifeline()
        return code

    def _close_lifeline(self) -> None:
        # Once the watchdog has exited the pipe serves no purpose; closing it keeps a long-lived
        # owner that starts many helpers from collecting descriptors.
        with self._lifeline_lock:
            descriptor, self._lifeline = self._lifeline, None
        if descriptor is not None:
            os.close(descriptor)


def stop_process(process: subprocess.Popen, timeout_s: float) -> int:
    """Stop a child in order and return its exit code: SIGTERM (its own orderly stop), then
    SIGKILL if it is still running `timeout_s` seconds later. A child that has already exited is
    only reaped."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


# -- working folders deleted when their owner dies ---------------------------------------------------

JANITOR_RETRY_S = 30.0
"""How long the janitor keeps trying to delete a folder after its owner died."""


class _FolderJanitor:
    """The owner's side: the janitor process, the write end of its pipe, the folders registered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._pipe: int | None = None
        self.folders: set[str] = set()

    def register(self, path: str) -> None:
        with self._lock:
            self.folders.add(path)
            self._send(b"+", path)

    def unregister(self, path: str) -> None:
        with self._lock:
            self.folders.discard(path)
            self._send(b"-", path)

    @property
    def pid(self) -> int | None:
        """The janitor's process id, None before the first folder (for tests)."""
        return None if self._process is None else self._process.pid

    def _send(self, kind: bytes, path: str) -> None:
        record = kind + os.fsencode(path) + b"\0"  # NUL ends a record: it cannot occur in a path
        if self._pipe is not None:
            try:
                os.write(self._pipe, record)  # under PIPE_BUF bytes: written whole or not at all
                return
            except OSError:
                pass  # the janitor died: a new one gets the whole list below
        self._start()

    def _start(self) -> None:
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        if self._process is not None:
            self._process.poll()  # collects a dead janitor's exit status
        read_end, write_end = os.pipe()  # close-on-exec: no helper we start inherits the write end
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), "--janitor", str(read_end)],
                pass_fds=(read_end,), start_new_session=True, cwd="/",
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self._pipe = write_end
        for folder in sorted(self.folders):
            os.write(self._pipe, b"+" + os.fsencode(folder) + b"\0")


_janitor = _FolderJanitor()


def tied_folder(prefix: str, parent: str | os.PathLike | None = None) -> str:
    """A new empty folder (tempfile.mkdtemp) that is deleted when this process dies, however it dies.

    Delete it with remove_tied_folder when done; until then it outlives nothing but this process.
    """
    import tempfile  # here, not at the top: the watchdog and the janitor run this module bare

    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        _janitor.register(path)
    except BaseException:
        os.rmdir(path)
        raise
    return path


def remove_tied_folder(path: str | os.PathLike) -> None:
    """Delete a folder made by tied_folder, with its contents, now; a missing folder is fine."""
    import shutil

    path = os.fspath(path)
    shutil.rmtree(path, ignore_errors=True)
    _janitor.unregister(path)


def janitor_pid() -> int | None:
    """The process id of this process's janitor, None if no folder was ever tied (for tests)."""
    return _janitor.pid


def _run_janitor(lifeline: int) -> None:
    """Track the owner's folders until the pipe ends, then delete those it has not deleted itself."""
    import shutil

    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # not ours to obey: only the pipe's end matters
    folders: set[str] = set()
    pending = b""
    while True:
        chunk = os.read(lifeline, 65536)
        if not chunk:
            break
        *records, pending = (pending + chunk).split(b"\0")
        for record in records:
            path = os.fsdecode(record[1:])
            if record[:1] == b"+":
                folders.add(path)
            elif record[:1] == b"-":
                folders.discard(path)
    deadline = time.monotonic() + JANITOR_RETRY_S
    while folders and time.monotonic() < deadline:
        for path in sorted(folders):
            if not os.path.islink(path):  # never follow a link out of the folder we were given
                shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path) or os.path.islink(path):
                folders.discard(path)
        if folders:
            time.sleep(0.2)  # a server still being stopped may be writing in its folder


# -- the watchdog: runs as `python -I -S processes.py LIFELINE_FD GRACE_S -- COMMAND...` ---------------


class _Watchdog:
    """Runs one helper, reaps every child, and ends every descendant when the helper or the owner ends."""

    def __init__(self, lifeline: int, grace_s: float) -> None:
        self.lifeline = lifeline
        self.grace_s = grace_s
        self.helper = 0
        self.helper_status: int | None = None
        os.set_inheritable(lifeline, False)  # the helper must not keep the pipe open itself
        if _prctl is not None:
            # Orphans among the helper's descendants (a daemon that forked away and left the process
            # group, as Fossil's backoffice does) are re-parented to us rather than to init, so
            # they can still be found and ended.
            _prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        # A child's exit must wake the select() below: Python writes each caught signal's number
        # to this pipe, and SIGCHLD is caught by a handler that does nothing else.
        self.wakeup, wakeup_write = os.pipe()
        os.set_blocking(self.wakeup, False)
        os.set_blocking(wakeup_write, False)
        signal.set_wakeup_fd(wakeup_write)
        signal.signal(signal.SIGCHLD, lambda _signum, _frame: None)

    def run(self, command: list[str]) -> int:
        """The helper's exit status. When the owner goes first, every descendant is ended and the
        watchdog dies with its process group instead of returning."""
        self.helper = self._spawn(command)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._pass_on)
        while True:
            readable, _, _ = select.select([self.lifeline, self.wakeup], [], [])
            self._reap()
            if self.helper_status is not None:
                self._kill_descendants()  # what the helper left running (a daemon it started)
                return self.helper_status
            if self.lifeline in readable and not os.read(self.lifeline, 1):
                break  # end of file: the owner is gone (it never writes)
        for pid in self._descendants():
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while self.helper_status is None and time.monotonic() < deadline:
            select.select([self.wakeup], [], [], max(0.0, deadline - time.monotonic()))
            self._reap()
        self._kill_descendants()
        # Also ends any member of the group that /proc did not show (no /proc off Linux), and us.
        os.killpg(os.getpgrp(), signal.SIGKILL)
        return 1  # not reached

    def _spawn(self, command: list[str]) -> int:
        watchdog = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: one thread, so calling Python code before exec is safe
            try:
                die_with_parent(signal.SIGKILL, parent_pid=watchdog)
                os.execvp(command[0], command)
            except BaseException as error:
                os.write(2, f"watchdog: cannot run {command[0]!r}: {error}\n".encode())
            finally:
                os._exit(127)
        return pid

    def _pass_on(self, signum: int, _frame: object) -> None:
        # Someone signalled the watchdog alone: the helper is the one meant to act on it. Until we
        # collect its status, its pid cannot belong to another process.
        if self.helper_status is None:
            _signal(self.helper, signum)

    def _reap(self) -> None:
        """Collect every exited child (the helper, and adopted orphans), noting the helper's status."""
        while True:
            try:
                os.read(self.wakeup, 512)
            except BlockingIOError:
                pass
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.helper:
                self.helper_status = os.waitstatus_to_exitcode(status)

    def _descendants(self) -> list[int]:
        """Our live descendants, read from /proc (empty where there is none)."""
        children: dict[int, list[int]] = {}
        try:
            names = os.listdir("/proc")
        except OSError:
            return []
        for name in names:
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as file:
                    stat = file.read()
            except OSError:
                continue  # it exited meanwhile
            # The fields after the command name (which may hold spaces and parentheses): state, ppid.
            state, parent = stat[stat.rindex(b")") + 2:].split()[:2]
            if state != b"Z":
                children.setdefault(int(parent), []).append(int(name))
        found: list[int] = []
        pending = [os.getpid()]
        while pending:
            kids = children.get(pending.pop(), [])
            found.extend(kids)
            pending.extend(kids)
        return found

    def _kill_descendants(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every descendant, again and again until none is left (their orphans come to us)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            descendants = self._descendants()
            if not descendants:
                break
            for pid in descendants:
                _signal(pid, signal.SIGKILL)
            time.sleep(0.01)
            self._reap()
        self._reap()  # our dead children: left unreaped, they would pass to init as zombies


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _exit_like(status: int) -> None:
    """Exit with the helper's status; a helper killed by a signal makes the watchdog die of it too,
    so the owner reads the same negative returncode it would have read from the helper."""
    if status >= 0:
        sys.exit(status)
    signum = -status
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU and friends must not leave a core file
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    sys.exit(128 + signum)  # a signal whose default action is not to terminate


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--janitor":
        _run_janitor(int(sys.argv[2]))
        sys.exit(0)
    if len(sys.argv) < 5 or sys.argv[3] != "--":
        sys.exit("usage: processes.py LIFELINE_FD GRACE_S -- COMMAND...")
    _exit_like(_Watchdog(int(sys.argv[1]), float(sys.argv[2])).run(sys.argv[4:]))
