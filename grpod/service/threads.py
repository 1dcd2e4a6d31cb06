"""`run_stoppable`: a blocking call in a worker thread that a cancellation of its caller asks to
stop, instead of waiting for it to finish.

anyio cannot interrupt a thread: a cancelled `to_thread.run_sync` either waits for the call to
return (a stop during the tiny model's build then waited out its 40 s warm-up and went on to
launch vLLM) or abandons the thread, which then writes on with no owner. Here the call is given a
`threading.Event` that the cancellation sets; the call polls it at its safe points and ends early,
and the caller still waits for the thread to return, so nothing runs on after its owner is gone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.lowlevel

T = TypeVar("T")


async def run_stoppable(call: Callable[[threading.Event], T]) -> T:
    """`call(stop)` in a worker thread; its result, or what it raised.

    A cancellation of the caller sets `stop` and waits for the call to return (it must poll `stop`
    often enough for that to be prompt); then the cancellation propagates, and whatever the call
    returned or raised on being stopped is dropped."""
    stop = threading.Event()
    result: T | None = None
    error: Exception | None = None

    async def stop_when_cancelled() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            stop.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_when_cancelled)
        try:
            result = await anyio.to_thread.run_sync(call, stop)
        except Exception as exc:  # noqa: BLE001 — raised below unless a cancellation comes first
            error = exc
        tg.cancel_scope.cancel()
    await anyio.lowlevel.checkpoint_if_cancelled()
    if error is not None:
        raise error
    return result
