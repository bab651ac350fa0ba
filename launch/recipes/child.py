"""A recipe's phase (SFT, an evaluation) run in a fresh process, so that its memory goes back to
the system when it ends.

An experiment runs its phases one after another from one orchestrating process. A phase that
loads a model in that process leaves it holding gigabytes after the phase is over: the allocator
keeps freed memory for reuse, and torch's thread pools and caches stay. The RL phase then runs
its learner and actors beside an orchestrator of 7-8 GB. `run_in_child` runs one phase in a
spawned interpreter (not a fork: nothing of the parent's threads, locks or memory comes along)
and hands its return value back; its notes reach the parent's `note` as they are written, and an
exception in the child is raised again in the parent. The child ends (SIGTERM) when the parent
does, however the parent ends: an experiment stopped with SIGTERM or SIGKILL leaves no phase
training on by itself.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import sys
from typing import Any, Callable

from longhorizon.common.processes import die_with_parent


class ChildPhaseError(RuntimeError):
    """A phase's process ended without a result (killed, out of memory)."""


def _child_main(messages, function: Callable, args: tuple, kwargs: dict, notes: bool, progress: bool,
                parent_pid: int) -> None:
    # The parent's thread that started this process waits in run_in_child until it ends, so the
    # kernel's parent-death signal fires only when the parent itself is gone.
    die_with_parent(signal.SIGTERM, parent_pid=parent_pid)
    if notes:
        kwargs["note"] = lambda text: messages.put(("note", text))
    if progress:
        kwargs["progress_stream"] = sys.stderr
    try:
        result = function(*args, **kwargs)
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the parent to raise
        try:
            messages.put(("error", error))
        except Exception:  # noqa: BLE001 - an exception that cannot be pickled goes as its text
            messages.put(("error", RuntimeError(f"{type(error).__name__}: {error}")))
        return
    messages.put(("result", result))


def run_in_child(function: Callable[..., Any], *args: Any, note: Callable[[str], None] | None = None,
                 progress_stream=None, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` in a spawned process; its return value (picklable).

    With `note`, the function is called with a `note` of its own whose lines the parent passes to
    this one; with `progress_stream`, it gets the child's stderr as its `progress_stream` (a
    stream cannot cross processes; the child's stderr is the parent's)."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    process = context.Process(
        target=_child_main, name=getattr(function, "__name__", "phase"),
        args=(messages, function, args, kwargs, note is not None, progress_stream is not None, os.getpid()),
    )
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
                        raise ChildPhaseError(
                            f"the {process.name} phase's process ended with exit code {process.exitcode} and no "
                            f"result (a negative code is the signal that killed it: -9 is the kernel's out-of-memory "
                            f"killer or a SIGKILL)") from None
                else:
                    continue
            if kind == "note":
                note(value)
            elif kind == "error":
                raise value
            else:
                return value
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()
            process.join()
        messages.close()
