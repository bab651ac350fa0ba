"""Start a run's learner and actors by forking one process that imported torch and transformers once.

A worker started as `python -m longhorizon.launch.worker` spends about 5 s of CPU importing torch,
transformers and the model's code before it does anything; a run starts one per learner rank and
actor, and again at every restart. The local launcher instead forks them from a fork server (this
module run as a script), started on the launcher's first run and kept for the runs that follow in
the same process (an experiment's phases, a script's runs): it imports those modules once, then
forks a worker for each request and reports each worker's exit. A forked worker runs the same `longhorizon.launch.worker` code with
the arguments, environment, working folder and log file the launcher gives it, in a session of
its own, exactly as the process `python -m longhorizon.launch.worker` would; only the imports are
already done.

The launcher and the server talk over a Unix socket pair (SOCK_SEQPACKET, one JSON message per
packet). A request carries the worker's arguments, environment and folder, with its log file's
descriptor attached; the reply carries the pid, with a pidfd attached, which lets the launcher
signal that process without a race against pid reuse and see it end even when the server cannot
tell it. The server reaps its children and sends `{"exited": pid, "code": ...}` (Popen's
convention: negative for a signal).

Lifetimes: the server ends when the launcher's end of the socket closes, however the launcher
ends (SIGKILL included); a worker gets SIGTERM when the server ends (PR_SET_PDEATHSIG, which
launch/worker.py sets first thing), so no worker outlives its launcher, as before.

What forking changes, and how it is kept the same: the server must hold no threads of its own
when it forks (it imports, it never computes; torch starts no work at import); every value a
module computed from the environment at import is computed from the launcher's environment, which
every worker inherits anyway (the per-worker variables, credentials, TMPDIR and the ranks'
rendezvous, are read after start-up, and `tempfile`'s cached folder is cleared), and a server is
reused only while the variables modules read at import (`IMPORT_TIME_VARIABLES`) are unchanged. Python's and
numpy's global random states seed themselves again in a forked child; torch's default seed is the
same in every process anyway. The workers of one run share the server's string-hash seed, which
orders sets of strings alike in each of them (nothing of ours depends on that order). The server's command line is what `ps` shows for
each worker; its name (`comm`) says the role (`lh-learner`, `lh-actor-3`).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

from longhorizon.common.processes import die_with_parent, set_process_name

_MAX_MESSAGE_BYTES = 4 << 20  # an environment with many variables is still far below this
_MAX_FDS = 8  # a request's descriptors: stdout, stderr and what it passes on
WORKER_ENTRY = "longhorizon.launch.worker:run_as_process"
"""What a forked child runs, `module:function`, called with the request's arguments."""
# Imported by every server: the worker's code, and what each role's start-up imports.
BASE_PRELOAD = (
    "torch", "transformers", "longhorizon.launch.worker", "longhorizon.learner.worker",
    "longhorizon.actor.worker", "longhorizon.actor.engines.hf",
)


class ForkServerError(RuntimeError):
    """The fork server could not start a worker (it is gone, or the request was refused)."""


# -- the launcher's side -----------------------------------------------------------------------


class ForkServer:
    """The launcher's handle on one fork server: `spawn` starts a worker, `close` ends the server.

    Safe to use from several threads (one request at a time)."""

    def __init__(self, preload: Sequence[str] = BASE_PRELOAD) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._channel = ours
        self._lock = threading.RLock()
        self._codes: dict[int, int] = {}
        self._running: set[int] = set()  # forked, their exit not reported yet
        self._gone = False
        try:
            # A session of its own: a Ctrl-C meant for the launcher does not reach it; it ends
            # when the launcher does (its end of the socket closes).
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(theirs.fileno()), *preload],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            theirs.close()

    @property
    def alive(self) -> bool:
        """False once it is known to be gone (closed, or its end of the socket seen closed)."""
        if not self._gone and self.process.poll() is not None:
            self._gone = True
        return not self._gone

    def spawn(
        self, argv: Sequence[str], *, env: dict[str, str], log_file=None, name: str, entry: str = WORKER_ENTRY,
        preload: Sequence[str] = (), streams: tuple[int, int] | None = None, pass_fds: Sequence[int] = (),
        sys_path: Sequence[str] | None = None,
    ) -> "ForkedProcess":
        """Fork a worker that runs `entry` (`module:function`, by default the worker's main) with
        `argv`, `env` as its whole environment, this process's working folder as its own and
        `log_file` (an open file) as its stdout and stderr, or `streams` (two descriptors) as
        them; `name` becomes its process name. `pass_fds` are descriptors the child gets too,
        their numbers there appended to its arguments; `sys_path`, its import path (default: as
        `python -m` in this folder would have it). The server first imports what of `preload` it
        has not (kept for later workers). Waits for the server's preloading on first use."""
        if (log_file is None) == (streams is None):
            raise ValueError("give a log file or two stream descriptors")
        outputs = [log_file.fileno()] * 2 if streams is None else list(streams)
        request = json.dumps({"argv": list(argv), "env": env, "cwd": os.getcwd(), "name": name,
                              "entry": entry, "preload": list(preload), "sys_path": sys_path}).encode()
        with self._lock:
            if self._gone:
                raise ForkServerError("the fork server has ended")
            try:
                socket.send_fds(self._channel, [request], [*outputs, *pass_fds])
            except OSError as error:
                self._gone = True
                raise ForkServerError(f"the fork server is gone ({error})") from None
            while True:
                message, fds = self._receive(timeout=None)
                if message is None:
                    raise ForkServerError("the fork server ended before it started the worker")
                if "pid" in message:
                    # A code left by an earlier child of the same pid, whose handle was dropped
                    # unpolled, is not this one's.
                    self._codes.pop(message["pid"], None)
                    self._running.add(message["pid"])
                    return ForkedProcess(self, message["pid"], fds[0])
                if "error" in message:
                    raise ForkServerError(message["error"])

    def idle(self) -> bool:
        """No worker of its own still running (as far as it has reported)."""
        with self._lock:
            while self._running and self._receive(timeout=0.0)[0] is not None:
                pass
            return not self._running

    def exit_code(self, pid: int, timeout: float | None = 0.0) -> int | None:
        """The worker's exit code once the server has reported it; waits up to `timeout`
        seconds for the report (None: until it comes or the server is gone)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while pid not in self._codes and not self._gone:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                if self._receive(timeout=remaining)[0] is None:
                    break  # nothing more in time
            return self._codes.pop(pid, None)

    def _receive(self, timeout: float | None) -> tuple[dict | None, list[int]]:
        """One message (exit reports are filed as they come); (None, []) when none came in time or
        the server is gone."""
        if self._gone:
            return None, []
        ready, _, _ = select.select([self._channel], [], [], timeout)
        if not ready:
            return None, []
        try:
            data, fds, _, _ = socket.recv_fds(self._channel, _MAX_MESSAGE_BYTES, 1)
        except OSError:
            data, fds = b"", []
        if not data:
            self._gone = True
            return None, []
        message = json.loads(data)
        if "exited" in message:
            self._codes[message["exited"]] = message["code"]
            self._running.discard(message["exited"])
        return message, fds

    def close(self, timeout_s: float = 10.0) -> None:
        """End the server (its workers should have ended: those left get SIGTERM from the kernel)."""
        with self._lock:
            self._gone = True
            self._channel.close()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ForkedProcess:
    """A worker the fork server started, with the part of `subprocess.Popen`'s interface the
    launcher uses: `pid`, `returncode`, `poll`, `wait`, `send_signal`, `terminate`, `kill`."""

    def __init__(self, server: ForkServer, pid: int, pidfd: int) -> None:
        self.server, self.pid, self._pidfd = server, pid, pidfd
        self.returncode: int | None = None

    def _exited(self) -> bool:
        """Whether the process has ended (its pidfd turns readable then, reaped or not)."""
        return bool(select.select([self._pidfd], [], [], 0)[0])

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self.server.exit_code(self.pid)
            if code is None and not self.server.alive and self._exited():
                # The server that could tell the code is gone: the process ended all the same.
                code = -signal.SIGKILL
            if code is not None:
                self._finish(code)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            # Its end shows on the pidfd; the server's report follows at once.
            select.select([self._pidfd], [], [], 0.5 if remaining is None else min(0.5, remaining))
            if self._exited():
                code = self.server.exit_code(self.pid, timeout=2.0)
                if code is not None:
                    self._finish(code)
        return self.returncode

    def _finish(self, code: int) -> None:
        self.returncode = code
        os.close(self._pidfd)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        if self.returncode is None:
            try:
                os.close(self._pidfd)
            except OSError:
                pass


IMPORT_TIME_VARIABLES = (
    "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "OPENBLAS_",
    "CUDA_", "NCCL_", "TRITON_", "VLLM_", "LONGHORIZON_", "PYTHON", "LD_",
)
"""Prefixes of the environment variables a module may read as it is imported (caches, devices,
thread counts, our own): a shared server is used only while these are as they were when it
started. Every other variable reaches a worker all the same, in the environment it is given."""
_shared: dict[tuple, ForkServer] = {}
_shared_lock = threading.Lock()


def shared_fork_server() -> ForkServer:
    """This process's fork server for its current environment: started on first use, then kept
    for the runs that follow (an experiment's RL runs and arms, a script's several runs, a test
    session's runs) until this process ends. A change to a variable of `IMPORT_TIME_VARIABLES`
    starts another; one that has died is replaced."""
    key = (sys.executable, *sorted((name, value) for name, value in os.environ.items()
                                   if name.startswith(IMPORT_TIME_VARIABLES)))
    with _shared_lock:
        server = _shared.get(key)
        if server is None or not server.alive:
            if not _shared:
                atexit.register(_close_shared)
            # Servers for another environment with no worker left are not kept (each holds the
            # imports' memory); one whose workers run stays until they end or this process does.
            for other_key, other in list(_shared.items()):
                if other_key != key and (not other.alive or other.idle()):
                    other.close()
                    del _shared[other_key]
            server = _shared[key] = ForkServer(BASE_PRELOAD)
        return server


def _close_shared() -> None:
    with _shared_lock:
        servers = list(_shared.values())
        _shared.clear()
    for server in servers:
        server.close()


def fork_server_supported() -> bool:
    """Linux with pidfds (5.3 or later) and Python's descriptor passing."""
    return hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal") and hasattr(socket, "send_fds")


def preload_for(model_folder: str | Path | None) -> list[str]:
    """What a run's workers import beyond the base modules: the model architecture's own module
    (named `model_type:<type>`, resolved by transformers in the server)."""
    modules = []
    if model_folder is not None:
        try:
            model_type = json.loads((Path(model_folder) / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            model_type = None
        if isinstance(model_type, str) and model_type.isidentifier():
            modules.append(f"model_type:{model_type}")
    return modules


# -- the server --------------------------------------------------------------------------------


def _preload(names: Sequence[str]) -> None:
    """Import what workers will import. A module that fails to import is left to the worker, which
    reports it as it would have without the server."""
    for name in names:
        try:
            if name.startswith("model_type:"):
                from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                import transformers

                class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(name.split(":", 1)[1])
                if class_name:
                    getattr(transformers, class_name)  # imports the architecture's module
            else:
                importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - a worker meets the same error and says it
            print(f"fork server: {name} not preloaded ({type(error).__name__}: {error})", file=sys.stderr)


def _serve(channel: socket.socket, preloaded: set[str]) -> dict | None:
    """Fork a worker per request until the launcher's end closes; returns the request in a forked
    child (which then becomes that worker), None in the server when it is done."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)  # SIGCHLD wakes the select below
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready, _, _ = select.select([channel, wake_read], [], [])
        if wake_read in ready:
            _drain(wake_read)
            if not _report_exits(channel):
                return None
        if channel not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(channel, _MAX_MESSAGE_BYTES, _MAX_FDS)
        except OSError:
            return None
        if not data:
            return None  # the launcher is done (or gone)
        if len(fds) < 2:
            for fd in fds:
                os.close(fd)
            _send(channel, {"error": "a request needs its output's descriptors"})
            continue
        request = json.loads(data)
        request["fds"] = fds
        _preload([name for name in request.get("preload", []) if name not in preloaded])
        preloaded.update(request.get("preload", []))
        # What the imports made goes to a generation the collector never walks: a child's
        # collections would otherwise touch (and so copy) every page of it.
        gc.collect()
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(wake_read)
            os.close(wake_write)
            channel.close()
            return request
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        sent = _send(channel, {"pid": pid}, [pidfd])
        os.close(pidfd)
        if not sent:
            return None


def _drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 512):
                return
        except BlockingIOError:
            return


def _report_exits(channel: socket.socket) -> bool:
    """Reap every ended child and tell the launcher; False once the launcher is gone."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return True
        if not _send(channel, {"exited": pid, "code": os.waitstatus_to_exitcode(status)}):
            return False


def _send(channel: socket.socket, message: dict, fds: Sequence[int] = ()) -> bool:
    try:
        socket.send_fds(channel, [json.dumps(message).encode()], list(fds))
        return True
    except OSError:
        return False


def _become_worker(request: dict, server_pid: int) -> None:
    """In a forked child: take the worker's session, files, environment and folder, then run its
    entry point as the whole process."""
    die_with_parent(parent_pid=server_pid)
    os.setsid()
    stdout_fd, stderr_fd, *passed = request["fds"]
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    for fd in {null, stdout_fd, stderr_fd} - {0, 1, 2}:
        os.close(fd)
    for fd in passed:
        os.set_inheritable(fd, False)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if request.get("sys_path") is not None:
        sys.path[:] = request["sys_path"]
    else:  # as `python -m` would have it: the working folder first on the import path
        sys.path[0] = request["cwd"]
    import tempfile

    tempfile.tempdir = None  # TMPDIR is the worker's own scratch folder
    set_process_name(request["name"])
    # The worker's own exit frees what the server froze, as a fresh process's exit would.
    atexit.register(gc.unfreeze)
    module_name, function_name = request["entry"].split(":")
    module = importlib.import_module(module_name)
    argv = [*request["argv"], *map(str, passed)]
    sys.argv = [getattr(module, "__file__", module_name), *argv]
    getattr(module, function_name)(argv)


def main(argv: list[str]) -> None:
    channel = socket.socket(fileno=int(argv[0]))
    server_pid = os.getpid()
    _preload(argv[1:])
    request = _serve(channel, set(argv[1:]))
    if request is None:
        # Nothing to save or flush; a normal exit would only report the frozen objects (torch's
        # extension modules check for leaks as the interpreter ends).
        os._exit(0)
    _become_worker(request, server_pid)
    sys.exit(0)  # an entry point that returned


if __name__ == "__main__":
    main(sys.argv[1:])
