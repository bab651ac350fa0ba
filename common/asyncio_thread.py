"""An asyncio event loop in a thread of its own, for trio code that must drive an asyncio library.

longhorizon runs on trio; Playwright (envs/web) and vLLM's asynchronous engine (actor/engines)
run on asyncio. Each such library gets one dedicated asyncio loop in a daemon thread, and trio
hands it coroutines with `asyncio.run_coroutine_threadsafe`. A trio task awaiting the result holds
no worker thread: the future's done-callback wakes trio through its token. We keep the loops apart
instead of using trio-asyncio because trio-asyncio replaces the process's asyncio event-loop
policy, which would change the loop of everything else in the process that uses asyncio; with a
thread per library both loops stay private. Objects of the asyncio library never leave its thread:
trio code holds handles and submits coroutine functions that use them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Awaitable, TypeVar

import trio

T = TypeVar("T")


class AsyncioThread:
    """One asyncio event loop running in a daemon thread; coroutines are submitted from other threads."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._loop.is_closed()

    def submit(self, coroutine: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Schedule `coroutine` on the loop; its result comes through the returned future."""
        if not self.running:
            raise RuntimeError(f"the asyncio thread {self.name!r} has been stopped")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)  # type: ignore[arg-type]

    def call_blocking(self, coroutine: Awaitable[T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for it from a plain (non-asyncio, non-trio) thread.

        Raises TimeoutError after `timeout` seconds; the coroutine then keeps running."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("call_blocking from the asyncio thread itself would deadlock")
        return self.submit(coroutine).result(timeout)

    async def call(self, coroutine: Awaitable[T]) -> T:
        """Run a coroutine on the loop and await it from trio without occupying a worker thread.

        When the trio task is cancelled, the asyncio task is cancelled too: its work is unwanted."""
        future = self.submit(coroutine)
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()

        def wake(_: concurrent.futures.Future) -> None:
            try:
                token.run_sync_soon(finished.set)
            except trio.RunFinishedError:
                pass  # the trio run that waited is gone; nobody needs the result

        future.add_done_callback(wake)
        try:
            await finished.wait()
        except BaseException:
            future.cancel()  # asyncio cancels the task on its own loop (run_coroutine_threadsafe's chaining)
            raise
        return future.result()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and wait up to `timeout` seconds for its thread (idempotent).

        A loop blocked in synchronous work cannot be stopped; its daemon thread ends with the process."""
        if self._thread.is_alive():
            try:
                self._loop.call_soon_threadsafe(self._loop.stop)
            except RuntimeError:  # closed between the check and the call
                pass
            self._thread.join(timeout)
