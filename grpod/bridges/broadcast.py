"""Bridge mode `broadcast`: the trainer sends its weights to every engine at once, as rank 0 of one
weight-transfer group, through vLLM's own weight-transfer API.

Each engine is launched with grpod's worker extension (`grpod.weights.gloo_engine`, which also
registers the `gloo` backend on CPU) and `--weight-transfer-config {"backend": <transport>}`:
NCCL on GPU (vLLM's engine), gloo on CPU. The data plane is `grpod.weights.transfer`; this module
holds only what the mode adds: when the group is formed, the fence around an update, and what a
failed update or a relaunched engine needs before it may serve again.

A sync, every `bridge.sync_every` steps:

    trainer half:  a copy of the trainer's weights (on one machine, the gather; later trainer
                   ranks gather to rank 0) and the probe scores of those weights
    engines' half: the group of this membership epoch (formed again whenever an engine was
                   relaunched since) → fence every engine (`/grpod/pause?mode=keep`) → start,
                   update while rank 0 broadcasts, finish with the weight version → prefix-cache
                   reset + version + resume (`/grpod/resume`) → alignment probe of every engine

An update that fails leaves engines that may serve a mix of two versions (vLLM's trap: see
`grpod.weights.gloo_engine`), so no engine reopens until a complete update and a passing probe:
a dead engine leaves the pool (its watch relaunches it; the only engine is relaunched by the sync
itself, with the restart budget), the group is formed again over the engines left and the whole
update sent once more; a second failure is FAILED. An engine relaunched between syncs is launched on the
run's initial weights and brought to the current version by an update of its own (the last
synced copy is kept for that), then probed against that version's scores — the trainer is not
read. The weights vLLM loads at launch are `model.path`, or on resume the checkpoint's, published
as `<run>/weights/vNNNNNN`.

Transition table:

    IDLE          --START------>  LAUNCHING
    LAUNCHING     --READY------>  PROBING
    PROBING       --PROBE_OK--->  SERVING
    PROBING       --PROBE_FAIL->  FAILED
    PROBING       --PROBE_SKIP->  SERVING       (bridge.probe_every: this sync is not probed)
    SERVING       --SYNC------->  SAVING        (a copy of the trainer's weights)
    SAVING        --SAVED------>  BROADCASTING  (group of this epoch, fence, update, resume)
    BROADCASTING  --APPLIED---->  PROBING
    SERVING       --LOST------->  RECOVERING    (relaunch, then a catch-up update of its own)
    RECOVERING    --RECOVERED-->  PROBING
    BROADCASTING  --LOST------->  RECOVERING    (an engine died mid-update: relaunch it)
    RECOVERING    --RETRY------>  BROADCASTING  (a new group, the whole update once more)
    FAILED        --SYNC------->  SAVING        (an operator's `ctl sync` retries)
    any           --FAIL------->  FAILED
    any           --STOP------->  STOPPING --STOPPED--> STOPPED
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import structlog

from grpod.bridges.base import Bridge, timed
from grpod.bridges.common import Event, mode_states, mode_table
from grpod.inference.client import InferenceRequestError
from grpod.inference.engine import InferenceEngine
from grpod.weights.transfer import (
    ENGINE_EXTENSION,
    EngineWeightClient,
    TransferConfig,
    WeightGroup,
    WeightTransferError,
    engine_launch_args,
    iter_state,
    open_weight_group,
)
from grpod.weights.versions import VersionedDirs

log = structlog.get_logger(__name__)

# The lifecycle states every mode has, plus the one this mode's sync passes through.
State = mode_states("BROADCASTING")


TABLE = mode_table(State, Event, "BROADCASTING")

Weights = list[tuple[str, Any]]


class BroadcastBridge(Bridge):
    mode = "broadcast"
    State = State
    Event = Event
    TABLE = TABLE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        c = self.cfg
        transport = c.transport if c.transport != "auto" else ("nccl" if self.engines[0].process.gpu else "gloo")
        self.transfer = TransferConfig(
            transport=transport, host=c.host, port=c.port, chunk_bytes=c.chunk_bytes,
            inflight_chunks=c.inflight_chunks, timeout_s=c.timeout_s,
        )  # fmt: skip
        self.versions = VersionedDirs(self.run_dir / "weights")
        self.group: WeightGroup | None = None
        self._group_stack: AsyncExitStack | None = None
        self._members: tuple | None = None  # the engines (and their launches) the group holds
        self.epoch = 0
        # The last synced weights: what a relaunched engine is brought up to date with.
        self._synced: tuple[int, Weights] | None = None

    def _launch_kwargs(self) -> dict[str, Any]:
        return {"worker_extension": ENGINE_EXTENSION, "extra_args": engine_launch_args(self.transfer.transport)}

    async def _initial_weights(self, resumed_weights: Path | None) -> Path:
        """Resuming: the checkpoint's weights, published (hard-linked) as the current version."""
        if resumed_weights is None:
            return self.model.path
        return await anyio.to_thread.run_sync(self.versions.adopt, self.policy.version, resumed_weights)

    async def _save(self, version: int) -> Weights:
        """A copy of the trainer's weights as vLLM's loader names them (the trainer steps on while
        the engines receive it); trainer ranks gather it to rank 0."""

        def copy() -> Weights:
            return list(iter_state(self.trainer.model, self.trainer.full_state_dict()))

        return await anyio.to_thread.run_sync(copy)

    # ---- the group of a membership epoch ------------------------------------------------------
    async def _weight_group(self, engines: list[InferenceEngine]) -> WeightGroup:
        """The group of this membership epoch: formed again whenever the members changed (an
        engine relaunched, left or rejoined) or the last update broke it."""
        members = tuple((engine.name, engine.launches) for engine in engines)
        if self.group is not None and not self.group.broken and members == self._members:
            return self.group
        await self._close_group()
        stack = AsyncExitStack()
        clients = [EngineWeightClient.for_process(engine.process) for engine in engines]
        try:
            self.group = await stack.enter_async_context(open_weight_group(clients, self.transfer))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stack.aclose()
            raise
        self._group_stack, self._members = stack, members
        self.epoch += 1
        log.info("weight_group_epoch", epoch=self.epoch, engines=[e.name for e in engines],
                 transport=self.transfer.transport, formation_s=round(self.group.formation_s, 3))
        return self.group

    async def _close_group(self, *, failed: str | None = None) -> None:
        """Release the members' group; `failed` (why a sync failed) releases it as a broken one."""
        if failed is not None and self.group is not None:
            self.group.fail(failed)
        stack, self._group_stack, self.group, self._members = self._group_stack, None, None, None
        if stack is not None:
            with anyio.CancelScope(shield=True):
                await stack.aclose()

    # ---- one update to every engine -----------------------------------------------------------
    async def _apply_engines(self, staged: Weights, version: int, phases: dict[str, float]) -> None:
        try:
            await self._update(self.pool.members(), staged, version, phases, epoch_group=True)
        except (WeightTransferError, InferenceRequestError) as exc:
            # No engine reopens on a partial update. A dead one leaves the pool, or (the only
            # engine) is relaunched; then a new group, and the whole update once more. The group
            # is released as a broken one: a frozen engine's release is not waited for a minute.
            await self._close_group(failed=f"sync to version {version} failed: {type(exc).__name__}")
            await self._meet_dead(self.pool.members(), exc, version, phases)
            log.warning("broadcast_retried", version=version, error=str(exc)[:300])
            await self._update(self.pool.members(), staged, version, phases, epoch_group=True)
        self._synced = (version, staged)

    async def _update(
        self, engines: list[InferenceEngine], staged: Weights, version: int, phases: dict[str, float],
        *, epoch_group: bool,
    ) -> None:
        """Fence `engines`, send `staged` as `version` to all of them in one group (the epoch's
        group of the members, or one of their own for a catch-up), resume them."""
        with timed(phases, "group"):
            group = await self._weight_group(engines) if epoch_group else None
        with timed(phases, "pause"):
            for engine in engines:
                await engine.pause()
        with timed(phases, "broadcast"):
            if group is not None:
                await group.sync(staged, weight_version=str(version))
            else:  # a catch-up: a group of its own for these engines, after the members' group (the
                # relaunch changed the members: the next sync forms it again) let go of rank 0's port
                await self._close_group()
                clients = [EngineWeightClient.for_process(engine.process) for engine in engines]
                async with open_weight_group(clients, self.transfer) as own:
                    await own.sync(staged, weight_version=str(version))
        with timed(phases, "reset_resume"):
            for engine in engines:
                assert engine.client is not None
                await engine.client.end_fence(version)

    async def _catch_up(self, engine: InferenceEngine) -> None:
        """A relaunched engine came up on the run's initial weights: send it the last synced ones
        (in a group of its own; the next sync forms the members' group again)."""
        if self._synced is None:
            return
        version, weights = self._synced
        await self._update([engine], weights, version, {}, epoch_group=False)
        log.info("engine_caught_up", engine=engine.name, version=version)

    async def stop(self) -> None:
        await self._close_group()
        await super().stop()

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "transfer": {"transport": self.transfer.transport, "epoch": self.epoch,
                         "group_broken": self.group.broken if self.group else None},
        }  # fmt: skip
