"""`RolloutBuffer`: accepted, not-yet-trained rollout groups, in arrival order (FIFO).

It is the one place accepted data lives between the source and the trainer, so a checkpoint can
record it (`snapshot`) and a resumed run can put it back (`restore`): nothing accepted is lost or
trained twice across a restart. Bounded: `put` waits while it is full, which is how the trainer
applies back-pressure to generation.
"""

from __future__ import annotations

from collections import deque

import anyio

from grpod.rollouts.group import RolloutGroup


class RolloutBuffer:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._groups: deque[RolloutGroup] = deque()
        self._changed = anyio.Condition()
        self.accepted = 0

    def __len__(self) -> int:
        return len(self._groups)

    async def put(self, group: RolloutGroup, timeout_s: float | None = None) -> None:
        with anyio.fail_after(timeout_s):
            async with self._changed:
                while len(self._groups) >= self.capacity:
                    await self._changed.wait()
                self._groups.append(group)
                self.accepted += 1
                self._changed.notify_all()

    async def take(self, n: int, *, timeout_s: float | None = None) -> list[RolloutGroup]:
        """Wait until `n` groups are buffered (TimeoutError after `timeout_s`), then take them."""
        with anyio.fail_after(timeout_s):
            async with self._changed:
                while len(self._groups) < n:
                    await self._changed.wait()
                taken = [self._groups.popleft() for _ in range(n)]
                self._changed.notify_all()
                return taken

    async def wait_for_room(self, n: int, timeout_s: float | None = None) -> None:
        """Wait until the buffer has room for `n` more groups (TimeoutError after `timeout_s`)."""
        with anyio.fail_after(timeout_s):
            async with self._changed:
                while self.capacity - len(self._groups) < n:
                    await self._changed.wait()

    async def wait_ready(self, n: int) -> None:
        """Wait until `n` groups are buffered, taking none (cancel it freely: nothing is lost)."""
        async with self._changed:
            while len(self._groups) < n:
                await self._changed.wait()

    async def take_available(self, n: int) -> list[RolloutGroup]:
        """Take up to `n` groups without waiting for more (after `wait_ready`, or when draining)."""
        async with self._changed:
            taken = [self._groups.popleft() for _ in range(min(n, len(self._groups)))]
            self._changed.notify_all()
            return taken

    def snapshot(self) -> list[RolloutGroup]:
        return list(self._groups)

    def restore(self, groups: list[RolloutGroup]) -> None:
        self._groups.extendleft(reversed(groups))
