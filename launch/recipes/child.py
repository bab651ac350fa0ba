"""A recipe's phase (SFT, an evaluation) run in a fresh process, so that its memory goes back to
the system when it ends.

An experiment runs its phases one after another from one orchestrating process. A phase that
loads a model in that process leaves it holding gigabytes after the phase is over: the allocator
keeps freed memory for reuse, and torch's thread pools and caches stay. The RL phase then runs
its learner and actors beside an orchestrator of 7-8 GB. `run_in_child` runs one phase in a
process of its own, forked from the fork server that imported torch and transformers once
(launch/launchers/fork_server.py), or a spawned interpreter where there is none: not a fork of
the parent, so nothing of its threads, locks or memory comes along. It hands the return value back; its notes reach the parent's `note` as they are written, and an
exception in the child is raised again in the parent. The child ends (SIGTERM) when the parent
does, however the parent ends: an experiment stopped with SIGTERM or SIGKILL leaves no phase
training on by itself.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterator

from longhorizon.common.processes import die_with_parent
from longhorizon.launch.launchers.fork_server import ForkServerError, fork_server_supported, shared_fork_server


class ChildPhaseError(RuntimeError):
    """A phase's process ended without a result (killed, out of memory)."""


def _run_phase(send: Callable[[tuple], None], function: Callable, args: tuple, kwargs: dict, notes: bool,
               progress: bool) -> None:
    """In the phase's process: run it, sending its notes and then its result or error."""
    if notes:
        kwargs["note"] = lambda text: send(("note", text))
    if progress:
        kwargs["progress_stream"] = sys.stderr
    try:
        result = function(*args, **kwargs)
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the parent to raise
        try:
            send(("error", error))
        except Exception:  # noqa: BLE001 - an exception that cannot be pickled goes as its text
            send(("error", RuntimeError(f"{type(error).__name__}: {error}")))
        return
    send(("result", result))


def _child_main(messages, function: Callable, args: tuple, kwargs: dict, notes: bool, progress: bool,
                parent_pid: int) -> None:
    # The parent's thread that started this process waits in run_in_child until it ends, so the
    # kernel's parent-death signal fires only when the parent itself is gone.
    die_with_parent(signal.SIGTERM, parent_pid=parent_pid)
    _run_phase(messages.put, function, args, kwargs, notes, progress)


def forked_phase_main(argv: list[str]) -> None:
    """A phase forked by the fork server: its connection's descriptor is the last argument; the
    phase itself comes first on it. (The server already tied this process to its own end.)"""
    connection = Connection(int(argv[-1]))
    function, args, kwargs, notes, progress = connection.recv()
    _run_phase(connection.send, function, args, kwargs, notes, progress)
    connection.close()
    sys.exit(0)


def run_in_child(function: Callable[..., Any], *args: Any, note: Callable[[str], None] | None = None,
                 progress_stream=None, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` in a process of its own; its return value (picklable).

    The process is forked from this process's fork server (launch/launchers/fork_server.py, which
    imported torch and transformers once), or spawned (a fresh interpreter) where there is none;
    either way nothing of this process's threads, locks or memory comes along, the environment,
    working folder and import path are this process's, and its stdout and stderr are these.
    With `note`, the function is called with a `note` of its own whose lines the parent passes to
    this one; with `progress_stream`, it gets the child's stderr as its `progress_stream` (a
    stream cannot cross processes; the child's stderr is the parent's)."""
    name = getattr(function, "__name__", "phase")
    phase = (function, args, kwargs, note is not None, progress_stream is not None)
    module = getattr(function, "__module__", None)
    # A function of a script (__main__) is found again only by spawn's re-import of that script.
    if fork_server_supported() and module not in (None, "__main__"):
        payload = ForkingPickler.dumps(phase)  # before the start: a phase that cannot go, fails here
        try:
            messages = _forked(name, payload, module)
        except ForkServerError:
            messages = _spawned(name, phase)  # slower to start, otherwise the same
    else:
        messages = _spawned(name, phase)
    with contextlib.closing(messages):  # closing it waits for the process and tidies up
        for kind, value in messages:
            if kind == "note":
                note(value)
            elif kind == "error":
                raise value
            else:
                return value


def _forked(name: str, payload: bytes, module: str) -> Iterator[tuple[str, Any]]:
    """Fork the phase from the fork server (ForkServerError at once if it cannot); then, as
    iterated, its messages until its result or error."""
    ours, theirs = multiprocessing.Pipe(duplex=True)
    try:
        process = shared_fork_server().spawn(
            [], env=dict(os.environ), streams=(1, 2), pass_fds=[theirs.fileno()], sys_path=sys.path,
            name=f"lh-{name}", entry="longhorizon.launch.recipes.child:forked_phase_main", preload=[module],
        )
    finally:
        theirs.close()
    return _forked_messages(name, payload, process, ours)


def _forked_messages(name: str, payload: bytes, process, ours) -> Iterator[tuple[str, Any]]:
    try:
        ours.send_bytes(payload)
        while True:
            if not ours.poll(0.5):
                if process.poll() is None:
                    continue
                if not ours.poll(1.0):  # the result may have been sent just before the exit
                    raise _ended_without_result(name, process.returncode)
            try:
                yield ours.recv()
            except EOFError:
                raise _ended_without_result(name, process.wait(timeout=30)) from None
    finally:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        ours.close()


def _ended_without_result(name: str, code: int | None) -> ChildPhaseError:
    return ChildPhaseError(
        f"the {name} phase's process ended with exit code {code} and no result (a negative code is the "
        f"signal that killed it: -9 is the kernel's out-of-memory killer or a SIGKILL)")


def _spawned(name: str, phase: tuple) -> Iterator[tuple[str, Any]]:
    """Spawn the phase; as iterated, its messages until its result or error."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    process = context.Process(target=_child_main, name=name, args=(messages, *phase, os.getpid()))
    process.start()
    try:
        while True:
            try:
                kind, value = messages.get(timeout=0.5)
            except queue.Empty:
                if not process.is_alive():
                    # The result may have been put just before the exit: one last look.
                    try:
                        kind, value = messages.get(timeout=1.0)
                    except queue.Empty:
                        raise _ended_without_result(name, process.exitcode) from None
                else:
                    continue
            yield kind, value
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join()
        messages.close()
