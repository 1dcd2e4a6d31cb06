"""`first_of`: the one way grpod races waits — run them together, the first to return wins and
the others are cancelled. (Written by hand it is a task group, a `nonlocal` result and a
`cancel_scope.cancel()` per wait; it was, six times.)"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio


async def first_of(*waits: Callable[[], Awaitable[Any]]) -> tuple[int, Any]:
    """(index, result) of the first of `waits` to return; the others are cancelled. A wait that
    raises first raises here (the others cancelled). The waits must be safe to cancel."""
    if not waits:
        raise ValueError("first_of needs at least one wait")
    winner: list[tuple[int, Any]] = []
    async with anyio.create_task_group() as tg:

        async def run(index: int, wait: Callable[[], Awaitable[Any]]) -> None:
            result = await wait()
            if not winner:
                winner.append((index, result))
            tg.cancel_scope.cancel()

        for index, wait in enumerate(waits):
            tg.start_soon(run, index, wait)
    return winner[0]
