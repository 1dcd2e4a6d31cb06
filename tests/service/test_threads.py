"""`run_stoppable`: a thread told to stop by its caller's cancellation, and waited for."""

import threading

import anyio
import pytest

from grpod.service.threads import run_stoppable

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_the_calls_result_and_error_reach_the_caller():
    with anyio.fail_after(10):
        assert await run_stoppable(lambda stop: 7) == 7

    def broken(stop):
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"), anyio.fail_after(10):
        await run_stoppable(broken)


async def test_a_cancellation_stops_the_call_and_waits_for_its_thread():
    started, ended = threading.Event(), threading.Event()

    def work(stop: threading.Event) -> str:
        started.set()
        try:
            if not stop.wait(30):
                return "ran to its end"
            raise RuntimeError("stopped")  # dropped: the cancellation wins
        finally:
            ended.set()

    with anyio.fail_after(20):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:

                async def cancel_once_started() -> None:
                    await anyio.to_thread.run_sync(started.wait, 10)
                    scope.cancel()

                tg.start_soon(cancel_once_started)
                await run_stoppable(work)
                pytest.fail("run_stoppable returned after a cancellation")
    assert scope.cancelled_caught
    assert ended.is_set(), "the thread was abandoned, not waited for"
