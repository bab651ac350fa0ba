"""The asyncio loop in its own thread that trio code hands coroutines to (common/asyncio_thread.py)."""

import asyncio
import threading

import pytest
import trio

from longhorizon.common.asyncio_thread import AsyncioThread


@pytest.fixture
def loop_thread():
    thread = AsyncioThread("test-asyncio")
    yield thread
    thread.stop()


async def _where_and_double(value: int) -> tuple[str, int]:
    await asyncio.sleep(0)
    return threading.current_thread().name, 2 * value


def test_coroutines_run_on_the_loop_thread_from_trio_and_from_a_plain_thread(loop_thread):
    async def from_trio() -> tuple[str, int]:
        return await loop_thread.call(_where_and_double(4))

    assert trio.run(from_trio) == ("test-asyncio", 8)
    assert loop_thread.call_blocking(_where_and_double(5), timeout=10) == ("test-asyncio", 10)


def test_an_exception_on_the_loop_reaches_the_trio_caller(loop_thread):
    async def fails() -> None:
        raise KeyError("on the loop")

    async def main() -> None:
        await loop_thread.call(fails())

    with pytest.raises(KeyError, match="on the loop"):
        trio.run(main)


def test_cancelling_the_trio_task_cancels_the_asyncio_task(loop_thread):
    started, cancelled = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main() -> None:
        with trio.move_on_after(0.2):
            await loop_thread.call(forever())

    trio.run(main)
    assert started.is_set()
    assert cancelled.wait(10)


def test_a_stopped_thread_refuses_work_and_blocking_from_its_own_loop_is_refused(loop_thread):
    async def call_blocking_on_the_loop() -> None:
        coroutine = _where_and_double(1)
        try:
            loop_thread.call_blocking(coroutine)
        finally:
            coroutine.close()

    with pytest.raises(RuntimeError, match="deadlock"):
        loop_thread.call_blocking(call_blocking_on_the_loop(), timeout=10)
    loop_thread.stop()
    assert not loop_thread.running
    coroutine = _where_and_double(1)
    with pytest.raises(RuntimeError, match="has been stopped"):
        loop_thread.submit(coroutine)
    coroutine.close()
    loop_thread.stop()  # a second stop does nothing
