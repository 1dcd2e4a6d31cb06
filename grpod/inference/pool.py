"""`EnginePool`: the engines one bridge keeps in step, as one object.

A bridge changes the weights its engines serve; the pool says which engines those are and what
they serve. It owns:

- the members: the engines a sync updates — all but those out of the pool being relaunched;
- who is current at which version: `mark_current` is the one place an engine is marked as serving
  a version after a change (a sync's apply, a relaunched engine's catch-up; a launch tags its own);
- leaving on death: an engine of a pool that died while being changed leaves it (gate closed, out
  of the syncs) and its health watch brings it back; the only engine, or the last one serving
  (the others being relaunched), cannot leave, and the change relaunches it instead (`drop_dead`
  says which is which);
- rejoining after relaunch + probe: the health watches (`watch`) hand a lost engine to `recover`,
  which calls the bridge's `bring_up` (relaunch on the current version's weights, catch up, probe);
  a passing probe admits it back (`admit`: gate open, in the syncs again);
- the turn: one change to the engines at a time — a sync, from its trainer half to its probe (a
  semaphore: the task that finishes a sync is not always the one that staged it), or a lost
  engine's recovery. A pool's other engines sync on while one relaunches (`syncs_meanwhile`).

The pool knows nothing of weights, modes or the trainer: what a relaunch, a catch-up and a probe
are is the bridge's `bring_up`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from grpod.errors import first_error
from grpod.inference.engine import InferenceEngine

log = structlog.get_logger(__name__)

# The bridge's one callback: relaunch a lost engine (the reason given), bring it to the current
# version and probe it; a passing probe admits it (`EnginePool.admit`). Called holding the turn.
BringUp = Callable[[InferenceEngine, str], Awaitable[None]]


@dataclass(frozen=True)
class Casualties:
    """What a failed change to some engines left: the `cause` (a lone task-group wrapper taken
    off), the engines that died, those of them that `left` the pool, and the engines still in it."""

    cause: BaseException
    dead: list[InferenceEngine]
    left: list[InferenceEngine]
    remaining: list[InferenceEngine]

    @property
    def stranded(self) -> list[InferenceEngine]:
        """Dead but still in the pool: the only engine, which the change relaunches itself."""
        return [engine for engine in self.dead if engine not in self.left]


class EnginePool:
    def __init__(self, engines: list[InferenceEngine], *, bring_up: BringUp, owner: str) -> None:
        """`owner`: the bridge mode, as the logs name it."""
        if not engines:
            raise ValueError("an engine pool needs at least one engine")
        self.engines = engines
        self.owner = owner
        self._bring_up = bring_up
        self.turn = anyio.Semaphore(1)
        # Whether a lost engine is recovered: the bridge serves (not starting, failed or stopping).
        self.serving = False

    @property
    def single(self) -> bool:
        return len(self.engines) == 1

    def members(self) -> list[InferenceEngine]:
        """The engines a sync updates: all but those being relaunched (they rejoin caught up)."""
        return [engine for engine in self.engines if not engine.recovering]

    @property
    def restarts(self) -> int:
        return sum(engine.restarts for engine in self.engines)

    # ---- versions and membership -------------------------------------------------------------
    def mark_current(self, engines: list[InferenceEngine], version: int) -> None:
        """`engines` serve `version` from now on (their gates open only once probed: `admit`)."""
        for engine in engines:
            engine.version = version

    def admit(self, engines: list[InferenceEngine]) -> None:
        """`engines` passed their probe: in the syncs again, gates open."""
        for engine in engines:
            engine.recovering = False
            engine.open()

    def _take_out(self, engine: InferenceEngine) -> None:
        engine.close()
        engine.recovering = True

    def leave(self, engine: InferenceEngine, cause: BaseException, version: int) -> bool:
        """`engine` died while changed or probed: one of a pool leaves it (gate closed, out of the
        syncs; its watch relaunches it, to rejoin after a probe) and the others go on. False for
        the only engine, and for the last one serving (the others are being relaunched): nothing
        would serve, and a sync would publish a version no engine has, so the change relaunches it."""
        if not any(other is not engine for other in self.members()):
            return False
        self._take_out(engine)
        log.warning("engine_left_sync", bridge=self.owner, engine=engine.name, version=version,
                    error=f"{type(cause).__name__}: {cause}"[:300], serving=[e.name for e in self.members()])
        return True

    async def drop_dead(self, engines: list[InferenceEngine], cause: BaseException, version: int) -> Casualties:
        """A change to (or probe of) `engines` failed with `cause`: those that do not answer
        `/health` died (or stalled, as their watch found), and those of a pool leave it."""
        while isinstance(cause, BaseExceptionGroup) and len(cause.exceptions) == 1:
            cause = cause.exceptions[0]  # a task group's wrapper: say what failed in it
        dead = [engine for engine in engines if await engine.lost()]
        left = [engine for engine in dead if self.leave(engine, cause, version)]
        return Casualties(cause, dead, left, [engine for engine in engines if engine not in left])

    # ---- losing an engine between changes ----------------------------------------------------
    async def watch(self) -> None:
        """Every engine's health watch, each handing a lost engine to `recover`, until cancelled.
        What `recover` raises ends them all and is raised as it is (out of the watches' group)."""
        try:
            async with anyio.create_task_group() as tg:
                for engine in self.engines:
                    tg.start_soon(engine.watch, self.recover)
        except BaseExceptionGroup as group:
            raise first_error(group, BaseException) or group from None

    async def recover(self, engine: InferenceEngine, reason: str) -> None:
        """A lost engine (`reason`: how its watch found it): relaunched, caught up and probed by
        the bridge's `bring_up`, holding the turn. Nothing is done while the bridge does not
        serve, or when the engine is no longer lost (a sync that met the loss first relaunched it)."""
        async with self.turn:
            if not self.serving or not await engine.lost():
                return
            if not self.single:
                self._take_out(engine)  # the others sync on without it
            await self._bring_up(engine, reason)

    @asynccontextmanager
    async def syncs_meanwhile(self, *, keep_turn: bool = False) -> AsyncIterator[None]:
        """Around a lost engine's relaunch, within `recover` (which holds the turn): the other
        engines of a pool sync on while it relaunches (the turn is let go until the block ends);
        the only engine keeps the turn, as no engine could be synced, and so does a relaunch within
        a sync (`keep_turn`: the sync it belongs to holds the turn until it ends)."""
        if self.single or keep_turn:
            yield
            return
        self.turn.release()
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):  # bounded: a sync's own timeouts bound its turn
                await self.turn.acquire()

    async def stop(self) -> None:
        """Shut every engine down (shielded: each waits until its engine released everything);
        one that fails to stop does not leave the others running: the first failure is raised
        once every engine was stopped."""
        failures: list[Exception] = []
        with anyio.CancelScope(shield=True):
            for engine in self.engines:
                try:
                    await engine.shutdown()
                except Exception as exc:  # noqa: BLE001 — raised below, after the others
                    log.error("engine_stop_failed", engine=engine.name, error=f"{type(exc).__name__}: {exc}"[:300])
                    failures.append(exc)
        if failures:
            raise failures[0]

    def describe(self) -> dict[str, Any]:
        """For `ctl status`: restarts, the first engine as `vllm`, and every engine."""
        engines = [engine.describe() for engine in self.engines]
        return {
            "restarts": self.restarts,
            "vllm": {key: engines[0][key] for key in ("pid", "running", "base_url", "available")},
            "engines": engines,
        }
