"""What every bridge mode shares: the sync protocol, the probe cadence and the state machine.

A bridge answers the one question the rest of grpod asks it: "do the engines serve the
trainer's weights, and which version are they?". It owns no process: each engine is an
`InferenceEngine` (process, client, gate, health watch, restart budget) handed to it — a
`SupervisedInference` on this node or a `RemoteInference` a `grpod agent` runs elsewhere — and
what the rest of grpod sees of the policy is the `Policy` handle it publishes to. Every sync
follows the same sequence, whatever the mode:

    SYNC → save (mode) → apply to each engine (mode) → version bump + prefix-cache reset → probe

A sync is two halves. `stage_sync` is the trainer's: save, and score the probe sequences with
the saved weights. `finish_sync` is the engines': apply, and probe against those scores. Modes
that ship a copy (`pipelined`) let the step loop train the next step between the halves; one
sync is in flight at a time (the next one, `recover` and `settled` wait for it).
`bridge.probe_every` probes only every N-th sync (always the first after a launch). A mode whose
optimizer step is the sync (`shared`) runs it inside `fence`, a line of the step loop.

The trainer is touched only by the task that owns it (the step loop, or start-up before it):
`stage_sync`, `fence` and a non-pipelined `finish_sync` run there. Recovery between syncs never
reads the trainer: it probes a relaunched engine against the scores recorded at the current
version's sync (every sync records them, probed or not).

A lost engine is met in one of two places, and both spend its restart budget:
- between syncs, by its health watch (`InferenceEngine.watch` → `recover`): relaunched on the
  weights of the current policy version and probed against that version's recorded scores;
- during a sync, by the sync itself (the apply step fails and the engine does not answer
  `/health`): relaunched on the weights it served before the sync, and the same sync applied once
  more, ending with the usual probe. A second failure, or a failure while the engine is healthy
  (it refused the weights), is FAILED.

Each mode's module holds only what is particular to it: its states, transition table and its
`_save` / `_apply` / `_launch_kwargs` / `_after_launch` / `_applied` pieces.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import anyio
import structlog

from grpod.bridges.machine import StateMachine
from grpod.bridges.probe import (
    ProbeMismatch,
    ProbeResult,
    ProbeSchedule,
    ProbeTolerance,
    probe_engines,
    trainer_scores,
)
from grpod.config import LORA_MODES, ModelConfig
from grpod.inference.engine import InferenceEngine, RestartBudgetSpent
from grpod.inference.policy import Policy

log = structlog.get_logger(__name__)

Update = Callable[[], Awaitable[object]]
# Upper bounds (s) of the sync-latency histogram `describe` reports (and Prometheus exposes).
SYNC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class BridgeFailed(RuntimeError):
    """The bridge cannot keep the engines' weights in step; training must stop (checkpoint first)."""


@dataclass
class SyncRecord:
    version: int
    phases: dict[str, float]
    total_s: float
    probe: dict[str, Any]
    forced: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "total_s": round(self.total_s, 4),
            "phases": {k: round(v, 4) for k, v in self.phases.items()},
            "probe": self.probe,
            "forced": self.forced,
        }


@dataclass
class StagedSync:
    """A sync whose trainer half is done: the weights of `version` are written where the mode's
    apply reads them, and `reference` holds the trainer's probe scores of those weights (None: the
    mode is not pipelined, and `finish_sync` scores them in the trainer's task). Nothing in it
    reads the trainer again, so the trainer may step while the engines apply it."""

    version: int
    staged: Any  # where the mode's apply reads the weights: a directory, or tensors in memory
    reference: list[list[float]] | None
    phases: dict[str, float]
    began: float
    forced: bool


@dataclass
class BridgeStats:
    syncs: int = 0
    last_sync: SyncRecord | None = None
    # Cumulative: syncs no longer than each bound of SYNC_BUCKETS, and the sum of all latencies.
    bucket_counts: list[int] = field(default_factory=lambda: [0] * len(SYNC_BUCKETS))
    seconds_sum: float = 0.0
    # Start-up: seconds until every engine was healthy, and of the first probe.
    startup: dict[str, float] = field(default_factory=dict)

    def add(self, record: SyncRecord) -> None:
        self.syncs += 1
        self.last_sync = record
        self.seconds_sum += record.total_s
        for i, bound in enumerate(SYNC_BUCKETS):
            if record.total_s <= bound:
                self.bucket_counts[i] += 1

    def histogram(self) -> dict[str, Any]:
        return {
            "buckets": [[bound, count] for bound, count in zip(SYNC_BUCKETS, self.bucket_counts, strict=True)],
            "count": self.syncs,
            "sum": round(self.seconds_sum, 4),
        }


class Bridge:
    mode: ClassVar[str]
    # Whether a sync can be split into `stage_sync` (trainer half) and `finish_sync` (engine
    # half) with training going on in between: true when the mode ships a copy of the weights.
    pipelined: ClassVar[bool] = True
    State: ClassVar[type[enum.Enum]]
    Event: ClassVar[type[enum.Enum]]
    TABLE: ClassVar[dict]

    def __init__(
        self,
        cfg,
        *,
        engines: list[InferenceEngine],
        trainer=None,
        model: ModelConfig,
        run_dir: Path,
        policy_version: int = 0,
    ) -> None:
        """`cfg` is this mode's `bridge` section; `model` says what vLLM serves (path, dtype). The
        trainer may come later (`provide_trainer`): the engines launch while it loads."""
        self.cfg = cfg
        self.model = model
        self.run_dir = run_dir
        self.trainer = None
        self._trainer_ready = anyio.Event()
        if trainer is not None:
            self.provide_trainer(trainer)
        self.engines = engines
        self.policy = Policy(engines, version=policy_version, lora=self.mode in LORA_MODES)
        self.machine = StateMachine(self.mode, self.TABLE, self.State["IDLE"])
        self.stats = BridgeStats()
        self.current_weights: Path = model.path
        # One sync at a time, from stage to finish (a semaphore: the finishing task is not
        # always the one that staged); recovery between syncs takes it too.
        self._sync_slot = anyio.Semaphore(1)
        self.probes = ProbeSchedule(cfg)

    def provide_trainer(self, trainer) -> None:
        self.trainer = trainer
        self._trainer_ready.set()

    async def _loaded_trainer(self):
        """The trainer, once loaded (start-up waits here for what needs it)."""
        await self._trainer_ready.wait()
        return self.trainer

    # ---- state ------------------------------------------------------------------------------
    def _fire(self, event: str, error: str | None = None) -> None:
        self.machine.fire(self.Event[event], error=error)

    @property
    def state(self) -> str:
        return self.machine.state.name

    @property
    def policy_version(self) -> int:
        return self.policy.version

    @property
    def available(self) -> bool:
        return self.policy.available

    @property
    def restarts(self) -> int:
        return sum(engine.restarts for engine in self.engines)

    # ---- launching (each mode adds its arguments and its after-launch step) -----------------
    def _launch_kwargs(self) -> dict[str, Any]:
        return {}

    async def _after_launch(self, engine: InferenceEngine) -> None:
        """A mode's step between an engine's launch and its probe (shared: attach the weights)."""

    def _served_name(self) -> str | None:
        """The model name that samples the current policy (None: the default, `policy`)."""
        return None

    async def _launch(self, engine: InferenceEngine, weights: Path) -> None:
        await engine.launch(weights, self.policy.version, **self._launch_kwargs())
        await self._after_launch(engine)

    async def _relaunch(self, engine: InferenceEngine, weights: Path, phases: dict[str, float] | None = None) -> None:
        """Stop the engine, wait until it released everything, launch it on `weights`."""
        self.probes.launched()
        await engine.relaunch(weights, self.policy.version, phases, **self._launch_kwargs())
        await self._after_launch(engine)

    async def _initial_weights(self, resumed_weights: Path | None) -> Path:
        """What the engines load first: the model, or (resuming) the checkpoint's weights."""
        return resumed_weights or self.model.path

    async def start(self, *, resumed_weights: Path | None = None) -> ProbeResult:
        """Launch every engine on the initial weights and probe them against the trainer.
        `resumed_weights`: the resumed checkpoint's copy of the policy, if any."""
        began = time.perf_counter()
        self._fire("START")
        self.current_weights = await self._initial_weights(resumed_weights)
        async with anyio.create_task_group() as tg:
            for engine in self.engines:
                tg.start_soon(self._launch, engine, self.current_weights)
        self._fire("READY")
        launched = time.perf_counter()
        result = await self._probe_and_serve(None)
        self.stats.startup = {
            "engines_healthy_s": round(launched - began, 3),
            "first_probe_s": round(time.perf_counter() - launched, 3),
        }
        return result

    async def _probe_and_serve(
        self, reference: list[list[float]] | None, engines: list[InferenceEngine] | None = None
    ) -> ProbeResult:
        """Probe `engines` (default: the members) against `reference` (trainer scores taken
        earlier), else the trainer's weights now; open them once they pass."""
        engines = engines or self.members()
        while True:
            try:
                result = await probe_engines(
                    engines, await self._loaded_trainer(), model=self.policy.served_name,
                    tolerance=ProbeTolerance.for_serving(self.model.dtype, self.cfg),
                    timeout_s=self.cfg.probe_timeout_s, reference=reference, version=self.policy.version,
                )
                break
            except ProbeMismatch as exc:
                self._fire("PROBE_FAIL", error=str(exc))
                raise
            except Exception as exc:  # noqa: BLE001 — an engine that died while probed leaves the pool
                engines = await self._without_dead(engines, exc)
        self._fire("PROBE_OK")
        self.probes.probed(self.policy.version, result.reference)
        for engine in engines:
            engine.open()
        return result

    # ---- syncs ------------------------------------------------------------------------------
    def sync_due(self, step: int) -> bool:
        return step % self.cfg.sync_every == 0

    async def after_step(self, step: int) -> SyncRecord | None:
        """A whole sync if one is due after `step` (the synchronous way; the step loop may pipeline)."""
        return await self.sync_now() if self.sync_due(step) else None

    async def fence(self, update: Update) -> SyncRecord | None:
        """Run one optimizer update (`update`, the trainer's apply). Modes that ship a copy need
        no fence: the update runs as is and the sync follows later. `shared` overrides this."""
        await update()
        return None

    async def sync_now(self, *, forced: bool = False) -> SyncRecord:
        """A whole sync: the engines serve the trainer's weights as the next version on return."""
        return await self.finish_sync(await self.stage_sync(forced=forced))

    async def stage_sync(self, *, forced: bool = False) -> StagedSync:
        """The trainer half of a sync: take the sync slot (waiting for the previous sync to
        finish), write the weights, score the probe with them. `finish_sync` must follow."""
        await self._sync_slot.acquire()
        began = time.perf_counter()
        new_version = self.policy.version + 1
        try:
            self._fire("SYNC")
            try:
                t = time.perf_counter()
                staged = await self._save(new_version)
                phases = {"save": time.perf_counter() - t}
                reference = None
                if self.pipelined:
                    t = time.perf_counter()
                    reference = await anyio.to_thread.run_sync(trainer_scores, self.trainer)
                    phases["score"] = time.perf_counter() - t
                self._fire("SAVED")
            except Exception as exc:
                message = f"sync to version {new_version} failed: {exc}"
                self._fire("FAIL", error=message)
                raise BridgeFailed(message) from exc
        except BaseException:
            self._sync_slot.release()
            raise
        return StagedSync(new_version, staged, reference, phases, began, forced)

    async def finish_sync(self, sync: StagedSync) -> SyncRecord:
        """The engines' half: apply the staged weights to each engine (recovering one that dies
        meanwhile), then probe them. Releases the sync slot."""
        try:
            phases, new_version = sync.phases, sync.version
            try:
                t = time.perf_counter()
                await self._apply_engines(sync.staged, new_version, phases)
                await self._applied(sync.staged, new_version)
                phases["apply"] = time.perf_counter() - t
                self.policy.publish(new_version, self._served_name())
                self._fire("APPLIED")
            except Exception as exc:
                message = f"sync to version {new_version} failed: {exc}"
                self._fire("FAIL", error=message)
                raise BridgeFailed(message) from exc
            if sync.reference is None:
                # Not pipelined: this runs in the trainer's task, whose weights are the synced ones.
                t = time.perf_counter()
                sync.reference = await anyio.to_thread.run_sync(trainer_scores, self.trainer)
                phases["score"] = time.perf_counter() - t
            t = time.perf_counter()
            if self.probes.due():
                probe = (await self._probe_and_serve(sync.reference)).as_dict()
                phases["probe"] = time.perf_counter() - t
            else:
                probe = self._serve_unprobed(sync)
            record = SyncRecord(new_version, phases, time.perf_counter() - sync.began, probe, sync.forced)
            self.stats.add(record)
            log.info("sync_done", bridge=self.mode, **record.as_dict())
            return record
        finally:
            self._sync_slot.release()

    def members(self) -> list[InferenceEngine]:
        """The engines a sync updates: all but those being relaunched (they rejoin caught up)."""
        return [engine for engine in self.engines if not engine.recovering]

    async def _apply_engines(self, staged: Any, version: int, phases: dict[str, float]) -> None:
        """Make every member engine serve `staged` as `version`, one after the other (a mode
        that updates them all at once overrides this)."""
        for engine in self.members():
            await self._apply_recovering(engine, staged, version, phases)

    async def _apply_recovering(self, engine: InferenceEngine, staged: Path, version: int, phases: dict[str, float]) -> None:
        try:
            await self._apply(engine, staged, version, phases)
        except Exception as exc:  # noqa: BLE001 — a dead engine is recovered, anything else fails the sync
            if await engine.healthy():
                raise
            if self._leave_sync(engine, exc, version):
                return
            await self._relaunch_mid_sync(engine, exc, version, phases)
            await self._apply(engine, staged, version, phases)
        engine.version = version

    def _leave_sync(self, engine: InferenceEngine, cause: Exception, version: int) -> bool:
        """An engine of a pool died during a sync: it leaves the sync (closed, out of the pool)
        and its watch relaunches it, to rejoin caught up after a probe; the others sync on. True
        when it left; the only engine is relaunched by the sync itself instead."""
        if len(self.engines) == 1:
            return False
        engine.close()
        engine.recovering = True
        log.warning("engine_left_sync", bridge=self.mode, engine=engine.name, version=version,
                    error=f"{type(cause).__name__}: {cause}"[:300], serving=[e.name for e in self.members()])
        return True

    async def _without_dead(self, engines: list[InferenceEngine], cause: Exception) -> list[InferenceEngine]:
        """The probe of `engines` failed short of a verdict (`cause`): those that died leave the
        pool (their watch relaunches them) and the others are probed again. Nothing dead, or none
        left to serve (the only engine), is FAILED: the run checkpoints and stops, saying why."""
        while isinstance(cause, BaseExceptionGroup) and len(cause.exceptions) == 1:
            cause = cause.exceptions[0]  # the probe's task group: say what failed in it
        dead = [engine for engine in engines if not await engine.healthy()]
        left = [engine for engine in dead if self._leave_sync(engine, cause, self.policy.version)]
        remaining = [engine for engine in engines if engine not in left]
        if not left or not remaining:
            message = (f"alignment probe at policy version {self.policy.version} failed: "
                       f"{type(cause).__name__}: {cause}"[:500])
            self._fire("FAIL", error=message)
            raise BridgeFailed(message) from cause
        return remaining

    def _serve_unprobed(self, sync: StagedSync) -> dict[str, Any]:
        assert sync.reference is not None
        self.probes.skipped(sync.version, sync.reference)
        self._fire("PROBE_SKIP")
        for engine in self.members():
            engine.open()
        return {"skipped": True, "syncs_since_probe": self.probes.unprobed}

    async def settled(self) -> None:
        """Return once no sync is in flight (a staged one has finished). Bounded by the sync's
        own request, probe and launch timeouts."""
        async with self._sync_slot:
            pass

    async def _bump_version_and_reset_cache(self, engine: InferenceEngine, version: int) -> None:
        """Every weight change: the new version on the engine's tokens, and no cached old-weight prefixes."""
        assert engine.client is not None
        await engine.client.reset_prefix_cache()
        await engine.client.update_weight_version(version)

    async def _save(self, version: int) -> Path:
        """Write what this mode ships to the engines for `version`; returns where it is."""
        raise NotImplementedError

    async def _apply(self, engine: InferenceEngine, staged: Path, version: int, phases: dict[str, float]) -> None:
        """Make `engine` serve `staged` as `version` (including cache reset and version bump)."""
        raise NotImplementedError

    async def _applied(self, staged: Any, version: int) -> None:
        """After every engine applied `version`: what the mode keeps of it (and what it prunes)."""

    async def _catch_up(self, engine: InferenceEngine) -> None:
        """After a relaunch between syncs: bring `engine` to the current version if a sync landed
        while it launched (it was launched on the weights current when the relaunch began)."""
        if engine.version != self.policy.version:
            await self._apply(engine, self._current_copy(), self.policy.version, {})
            engine.version = self.policy.version

    def _current_copy(self) -> Any:
        """What `_apply` reads to serve the current version (copy modes: the newest weights)."""
        return self.current_weights

    # ---- losing an engine -------------------------------------------------------------------
    async def _relaunch_mid_sync(self, engine: InferenceEngine, cause: Exception, version: int, phases: dict[str, float]) -> None:
        """An engine died while a sync was applied: relaunch it on the weights it served before
        the sync (the caller then applies the sync again). No probe here: the trainer is already
        at `version`, the engine is not yet."""
        began = time.perf_counter()
        reason = f"vLLM died during the sync to version {version} ({type(cause).__name__}: {cause})"
        try:
            engine.spend_restart(reason)
        except RestartBudgetSpent as exc:
            raise BridgeFailed(str(exc)) from cause
        self._fire("LOST", error=reason)
        log.warning("inference_lost", bridge=self.mode, engine=engine.name, pid=engine.process.pid,
                    restarts=engine.restarts, during="sync", error=str(cause))
        await self._relaunch(engine, self.current_weights)
        self._fire("RETRY")
        phases["recover"] = time.perf_counter() - began
        log.info("inference_recovered", bridge=self.mode, engine=engine.name, seconds=round(phases["recover"], 3), during="sync")

    async def watch(self) -> None:
        """Every engine's health watch, each recovering its engine (`recover`) when it is lost.
        Raises BridgeFailed (unwrapped from the watches' task group) when one cannot be."""
        try:
            async with anyio.create_task_group() as tg:
                for engine in self.engines:
                    tg.start_soon(engine.watch, self.recover)
        except BaseExceptionGroup as group:
            matched, _ = group.split(BridgeFailed)
            if matched is None:
                raise
            while isinstance(matched, BaseExceptionGroup):
                matched = matched.exceptions[0]
            raise matched from None

    async def recover(self, engine: InferenceEngine, reason: str) -> None:
        """Relaunch a lost engine on the current version's weights and probe it against that
        version's recorded scores (a sync that ran meanwhile may already have recovered it).
        The only engine: the bridge is RECOVERING meanwhile. One of a pool: `_recover_member`."""
        if len(self.engines) > 1:
            await self._recover_member(engine, reason)
            return
        async with self._sync_slot:
            if self.machine.state != self.State["SERVING"] or await engine.healthy():
                return
            began = time.perf_counter()
            try:
                engine.spend_restart(reason)
            except RestartBudgetSpent as exc:
                self._fire("FAIL", error=str(exc))
                raise BridgeFailed(str(exc)) from None
            self._fire("LOST", error=reason)
            log.warning("inference_lost", bridge=self.mode, engine=engine.name, pid=engine.process.pid,
                        restarts=engine.restarts, error=reason)
            await self._relaunch(engine, self.current_weights)
            await self._catch_up(engine)
            self._fire("RECOVERED")
            await self._probe_and_serve(self._reference_now(engine), engines=[engine])
            log.info("inference_recovered", bridge=self.mode, engine=engine.name, seconds=round(time.perf_counter() - began, 3))

    async def _recover_member(self, engine: InferenceEngine, reason: str) -> None:
        """One engine of a pool is lost: the others keep serving and syncing while it is
        relaunched (the sync slot is taken only to decide and, at the end, to catch it up to the
        current version and probe it); it rejoins the syncs only after a passing probe."""
        async with self._sync_slot:
            if self.machine.state != self.State["SERVING"] or await engine.healthy():
                return
            try:
                engine.spend_restart(reason)
            except RestartBudgetSpent as exc:
                self._fire("FAIL", error=str(exc))
                raise BridgeFailed(str(exc)) from None
            engine.close()
            engine.recovering = True
        began = time.perf_counter()
        log.warning("inference_lost", bridge=self.mode, engine=engine.name, pid=engine.process.pid,
                    restarts=engine.restarts, error=reason, serving=[e.name for e in self.members()])
        await self._relaunch(engine, self.current_weights)
        async with self._sync_slot:
            await self._catch_up(engine)
            result = await probe_engines(
                [engine], await self._loaded_trainer(), model=self.policy.served_name,
                tolerance=ProbeTolerance.for_serving(self.model.dtype, self.cfg), timeout_s=self.cfg.probe_timeout_s,
                reference=self._reference_now(engine), version=self.policy.version,
            )
            engine.recovering = False
            engine.open()
        log.info("inference_recovered", bridge=self.mode, engine=engine.name, rejoined_at=self.policy.version,
                 seconds=round(time.perf_counter() - began, 3), probe=result.as_dict())

    def _reference_now(self, engine: InferenceEngine) -> list[list[float]]:
        """The trainer's scores recorded at the current version's sync (a relaunched engine is
        probed against them, never against the trainer's live weights)."""
        reference = self.probes.reference_for(self.policy.version)
        if reference is None:
            message = f"no probe reference recorded for policy version {self.policy.version}; {engine.name} stays closed"
            self._fire("FAIL", error=message)
            raise BridgeFailed(message)
        return reference

    async def stop(self) -> None:
        if self.machine.can_fire(self.Event["STOP"]):
            self._fire("STOP")
        with anyio.CancelScope(shield=True):
            for engine in self.engines:
                await engine.shutdown()
        if self.machine.can_fire(self.Event["STOPPED"]):
            self._fire("STOPPED")

    def describe(self) -> dict[str, Any]:
        first = self.engines[0].describe()
        return {
            "mode": self.mode,
            "policy_version": self.policy.version,
            "syncs": self.stats.syncs,
            "sync_latency": self.stats.histogram(),
            "restarts": self.restarts,
            "last_sync": self.stats.last_sync.as_dict() if self.stats.last_sync else None,
            "weights": str(self.current_weights),
            "vllm": {key: first[key] for key in ("pid", "running", "base_url", "available")},
            "engines": [engine.describe() for engine in self.engines],
            **self.machine.describe(),
        }
