"""What every bridge mode shares: the sync protocol, the probe cadence and the state machine.

A bridge answers the one question the rest of grpod asks it: "do the engines serve the
trainer's weights, and which version are they?". It owns no process: each engine is an
`InferenceEngine` (process, client, gate, health watch, restart budget) handed to it — a
`SupervisedInference` on this node or a `RemoteInference` a `grpod agent` runs elsewhere — kept
in one `EnginePool` (`grpod.inference.pool`: the members, who is current at which version,
leaving on death, rejoining after a relaunch and a probe), and what the rest of grpod sees of the
policy is the `Policy` handle it publishes to. Every sync follows the same sequence, whatever
the mode:

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

A lost engine is met in one of two places (`EngineLosses`), and a relaunch spends its restart
budget:
- between syncs, by its health watch (the pool's `watch` → `recover` → this bridge's `_bring_up`):
  relaunched on the weights of the current policy version, caught up to it, and probed against
  that version's recorded scores; one of a pool is relaunched while the others sync on, and a
  relaunch that dies before it rejoins is found lost by its watch again;
- during a sync, by the sync itself (the apply step or the probe fails and the engine does not
  answer `/health`): one of a pool leaves it (its watch brings it back) and the sync goes on
  without it; the only engine, or the last one serving, lost in the apply step, is relaunched on
  the weights it served before the sync and the same sync applied once more, ending with the
  usual probe. A second failure, a failure while the engine is healthy (it refused the weights)
  or the only engine lost while probed is FAILED.
What a launch in progress reads (its weights, an adapter it preloads) is kept from the prunes of
the syncs that land meanwhile (`in_use`). A stop ends a recovery under way without a relaunch.

Each mode's module holds only what is particular to it: its states, transition table and its
`ModeSteps` (`_save` / `_apply` / `_launch_kwargs` / `_after_launch` / `_applied` ...).
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
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
from grpod.errors import first_error
from grpod.inference.engine import InferenceEngine, RestartBudgetSpent
from grpod.inference.policy import Policy
from grpod.inference.process import InferenceStartError
from grpod.inference.pool import EnginePool

log = structlog.get_logger(__name__)

Update = Callable[[], Awaitable[object]]
# Upper bounds (s) of the sync-latency histogram `describe` reports (and Prometheus exposes).
SYNC_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds the block took to `phases[name]` once it is done (a sync may pass through a
    phase twice: a retry); a block that raises adds nothing."""
    began = time.perf_counter()
    yield
    phases[name] = phases.get(name, 0.0) + time.perf_counter() - began


class BridgeFailed(RuntimeError):
    """The bridge cannot keep the engines' weights in step; training must stop (checkpoint first)."""


class SyncNotSaved(RuntimeError):
    """A sync's weights could not be written (no disk space, a read-only or failing filesystem):
    no engine was touched, they serve the last synced version; the bridge serves on and the next
    sync retries (the daemon's sync alarm says so meanwhile)."""


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

    def started(self, began: float, launched: float) -> None:
        """Start-up began at `began`, every engine was healthy at `launched`, the probe passed now."""
        now = time.perf_counter()
        self.startup = {"engines_healthy_s": round(launched - began, 3), "first_probe_s": round(now - launched, 3)}

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


class ModeSteps:
    """The steps a mode's module supplies to the sync protocol (`Bridge`), with their defaults:
    what the engines launch with and do after a launch, what a sync saves and how an engine
    applies it, and what brings a relaunched engine to the current version."""

    model: ModelConfig
    policy: Policy
    current_weights: Path
    launching: Counter[Path]  # what launches in progress read as they start (`_reading`)

    def _launch_kwargs(self) -> dict[str, Any]:
        return {}

    @contextmanager
    def _reading(self, weights: Path, launch_kwargs: dict[str, Any]) -> Iterator[None]:
        """Around a launch: the weights it loads and a LoRA adapter it preloads are in use until it
        returns (vLLM reads them while it starts, 10-100 s); `in_use` lists them for the prunes."""
        paths = Counter([Path(weights), *(Path(path) for path in (launch_kwargs.get("lora_modules") or {}).values())])
        self.launching += paths
        try:
            yield
        finally:
            self.launching -= paths  # (a Counter drops what reaches 0)

    def in_use(self, engines: list[InferenceEngine]) -> list[Path]:
        """What no prune may remove: each engine's launch weights and what launches in progress read."""
        return [engine.weights for engine in engines if engine.weights is not None] + list(self.launching)

    async def _after_launch(self, engine: InferenceEngine) -> None:
        """A mode's step between an engine's launch and its probe (shared: attach the weights)."""

    def _served_name(self) -> str | None:
        """The model name that samples the current policy (None: the default, `policy`)."""
        return None

    async def _launch(self, engine: InferenceEngine, weights: Path) -> None:
        """Launch `engine` on `weights` the mode's way: its arguments, then its after-launch step."""
        kwargs = self._launch_kwargs()
        with self._reading(weights, kwargs):
            await engine.launch(weights, self.policy.version, **kwargs)
        await self._after_launch(engine)

    async def _initial_weights(self, resumed_weights: Path | None) -> Path:
        """What the engines load first: the model, or (resuming) the checkpoint's weights."""
        return resumed_weights or self.model.path

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

    def _current_copy(self) -> Any:
        """What `_apply` reads to serve the current version (copy modes: the newest weights)."""
        return self.current_weights


class EngineLosses:
    """How a bridge meets a lost engine: the dead of a change leave the pool or are relaunched
    within it (`_meet_dead`), a lost engine is relaunched out of its restart budget
    (`_relaunch_lost`) and a relaunched one is caught up and probed before it rejoins (`_bring_up`,
    the pool's callback). `Bridge` supplies the state, the pool and the probes."""

    mode: ClassVar[str]
    machine: StateMachine
    pool: EnginePool
    policy: Policy
    probes: ProbeSchedule
    current_weights: Path
    _fire: Callable[..., None]
    _failed: Callable[[str], BridgeFailed]
    _relaunch: Callable[..., Awaitable[None]]
    _catch_up: Callable[[InferenceEngine], Awaitable[None]]
    _probe: Callable[..., Awaitable[ProbeResult]]
    _probe_and_serve: Callable[..., Awaitable[ProbeResult]]

    @property
    def _stopping(self) -> bool:
        """The bridge is stopping (or stopped): a recovery under way ends without relaunching."""
        return self.machine.state.name in ("STOPPING", "STOPPED")

    async def _meet_dead(self, engines: list[InferenceEngine], cause: Exception, version: int, phases: dict[str, float]) -> bool:
        """A sync's change to `engines` failed with `cause`: the dead of a pool leave it, the only engine is relaunched
        on the weights it served before (the caller applies the sync again). False: none died, they refused it."""
        lost = await self.pool.drop_dead(engines, cause, version)
        for engine in lost.stranded:
            await self._relaunch_mid_sync(engine, lost.cause, version, phases)
        return bool(lost.dead)

    async def _relaunch_lost(self, engine: InferenceEngine, reason: str, *, during: str | None = None) -> None:
        """Relaunch a lost engine on the current weights, out of its restart budget (spent: BridgeFailed,
        which a sync's failure reports as FAILED itself), once more for each launch that dies or hangs
        starting. The only engine, or the last one serving a sync (`during`): the bridge is RECOVERING
        meanwhile and the sync keeps its turn; between syncs a pool's others sync on."""
        self._spend_restart(engine, reason, during)
        serving = [e.name for e in self.pool.members() if e is not engine]
        log.warning("inference_lost", bridge=self.mode, engine=engine.name, pid=engine.process.pid,
                    restarts=engine.restarts, error=reason, during=during, serving=serving)
        alone = self.pool.single or during == "sync"
        if alone:
            self._fire("LOST", error=reason)
        async with self.pool.syncs_meanwhile(keep_turn=alone):
            while True:
                try:
                    return await self._relaunch(engine, self.current_weights)
                except InferenceStartError as exc:
                    if self._stopping:  # the bridge's stop ended this start: nothing to relaunch for
                        return
                    reason = f"its relaunch failed: {str(exc).splitlines()[0][:300]}"
                    log.warning("inference_relaunch_failed", engine=engine.name, restarts=engine.restarts, error=reason)
                    self._spend_restart(engine, reason, during)

    def _spend_restart(self, engine: InferenceEngine, reason: str, during: str | None) -> None:
        try:
            engine.spend_restart(reason)
        except RestartBudgetSpent as exc:
            raise (BridgeFailed(str(exc)) if during else self._failed(str(exc))) from None

    async def _relaunch_mid_sync(self, engine: InferenceEngine, cause: BaseException, version: int, phases: dict[str, float]) -> None:
        """The only engine (or the last one serving) died while a sync was applied: relaunch it on
        the weights it served before the sync (the caller then applies the sync again). No probe
        here: the trainer is already at `version`, the engine is not yet."""
        how = "stalled" if engine.stalled else "died"
        reason = f"vLLM {how} during the sync to version {version} ({type(cause).__name__}: {cause})"
        with timed(phases, "recover"):
            await self._relaunch_lost(engine, reason, during="sync")
            self._fire("RETRY")
        log.info("inference_recovered", bridge=self.mode, engine=engine.name, seconds=round(phases["recover"], 3), during="sync")

    async def _bring_up(self, engine: InferenceEngine, reason: str) -> None:
        """The pool's callback for an engine its watch found lost (it holds the pool's turn):
        relaunch it, catch it up to the current version and probe it against the scores recorded
        at that version's sync; the pool admits it once the probe passes."""
        began = time.perf_counter()
        await self._relaunch_lost(engine, reason)
        if self._stopping:
            return
        try:
            await self._catch_up(engine)
            self.pool.mark_current([engine], self.policy.version)
            # Probed against the trainer's scores recorded at the current version's sync, never its live weights.
            reference = self.probes.reference_for(self.policy.version)
            if reference is None:
                raise self._failed(f"no probe reference recorded for policy version {self.policy.version}; "
                                   f"{engine.name} stays closed")
            if self.pool.single:
                self._fire("RECOVERED")
                result = await self._probe_and_serve(reference, engines=[engine])
            else:
                result = await self._probe([engine], reference)
                self.pool.admit([engine])
        except Exception as exc:  # noqa: BLE001 — the new launch died rejoining (a pool retries), or failed
            cause = first_error(exc) or exc  # a task group's wrapper: say what failed in it
            if isinstance(cause, (BridgeFailed, ProbeMismatch)):
                raise
            error = f"{type(cause).__name__}: {cause}"[:300]
            if self._stopping:
                return
            if self.pool.single or not await engine.lost():
                raise self._failed(f"{engine.name} was relaunched ({reason[:200]}) but could not rejoin: {error}") from exc
            # Out of the syncs and closed still: its watch finds this launch lost too and relaunches it
            # within its restart budget, as it would any launch that dies.
            log.warning("inference_rejoin_failed", bridge=self.mode, engine=engine.name, restarts=engine.restarts,
                        error=error)
            return
        log.info("inference_recovered", bridge=self.mode, engine=engine.name, rejoined_at=self.policy.version,
                 seconds=round(time.perf_counter() - began, 3), probe=result.as_dict())


class Bridge(ModeSteps, EngineLosses):
    mode: ClassVar[str]
    # Whether a sync can be split into `stage_sync` (trainer half) and `finish_sync` (engine
    # half) with training going on in between: true when the mode ships a copy of the weights.
    pipelined: ClassVar[bool] = True
    State: ClassVar[type[enum.Enum]]
    Event: ClassVar[type[enum.Enum]]
    TABLE: ClassVar[dict]

    def __init__(self, cfg, *, engines: list[InferenceEngine], trainer=None, model: ModelConfig, run_dir: Path,
                 policy_version: int = 0) -> None:
        """`cfg` is this mode's `bridge` section; `model` says what vLLM serves (path, dtype). The
        trainer may come later (`provide_trainer`): the engines launch while it loads."""
        self.cfg = cfg
        self.model = model
        self.run_dir = run_dir
        self.trainer = None
        self._trainer_ready = anyio.Event()
        if trainer is not None:
            self.provide_trainer(trainer)
        # The engines, who serves which version, losses and rejoins; its turn is the sync slot.
        self.pool = EnginePool(engines, bring_up=self._bring_up, owner=self.mode)
        self.policy = Policy(engines, version=policy_version, lora=self.mode in LORA_MODES)
        self.machine = StateMachine(self.mode, self.TABLE, self.State["IDLE"])
        self.stats = BridgeStats()
        self.current_weights: Path = model.path
        self.launching = Counter()
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
        self.pool.serving = self.machine.state is self.State["SERVING"]

    def _failed(self, message: str) -> BridgeFailed:
        """FAILED, saying why; the caller raises what this returns."""
        self._fire("FAIL", error=message)
        return BridgeFailed(message)

    @property
    def state(self) -> str:
        return self.machine.state.name

    @property
    def engines(self) -> list[InferenceEngine]:
        return self.pool.engines

    @property
    def policy_version(self) -> int:
        return self.policy.version

    @property
    def available(self) -> bool:
        return self.policy.available

    @property
    def restarts(self) -> int:
        return self.pool.restarts

    # ---- launching (each mode adds its arguments and its after-launch step) -----------------
    async def _relaunch(self, engine: InferenceEngine, weights: Path, phases: dict[str, float] | None = None) -> None:
        """Stop the engine, wait until it released everything, launch it on `weights`."""
        self.probes.launched()
        kwargs = self._launch_kwargs()
        with self._reading(weights, kwargs):
            await engine.relaunch(weights, self.policy.version, phases, **kwargs)
        await self._after_launch(engine)

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
        self.stats.started(began, launched)
        return result

    # ---- probing ----------------------------------------------------------------------------
    async def _probe(self, engines: list[InferenceEngine], reference: list[list[float]] | None) -> ProbeResult:
        tolerance = ProbeTolerance.for_serving(self.model.dtype, self.cfg)
        return await probe_engines(engines, await self._loaded_trainer(), model=self.policy.served_name, tolerance=tolerance,
                                   timeout_s=self.cfg.probe_timeout_s, reference=reference, version=self.policy.version)

    async def _probe_and_serve(
        self, reference: list[list[float]] | None, engines: list[InferenceEngine] | None = None
    ) -> ProbeResult:
        """Probe `engines` (default: the members) against `reference` (trainer scores taken
        earlier), else the trainer's weights now; admit them once they pass. An engine that dies
        while probed leaves the pool and the others are probed again; nothing dead, or none left
        to serve (the only engine), is FAILED: the run checkpoints and stops, saying why."""
        engines = engines or self.pool.members()
        while True:
            try:
                result = await self._probe(engines, reference)
                break
            except ProbeMismatch as exc:
                self._fire("PROBE_FAIL", error=str(exc))
                raise
            except Exception as exc:  # noqa: BLE001 — an engine that died while probed leaves the pool
                lost = await self.pool.drop_dead(engines, exc, self.policy.version)
                if not lost.left or not lost.remaining:
                    message = f"alignment probe at policy version {self.policy.version} failed: "
                    raise self._failed(f"{message}{type(lost.cause).__name__}: {lost.cause}"[:500]) from lost.cause
                engines = lost.remaining
        self._fire("PROBE_OK")
        self.probes.probed(self.policy.version, result.reference)
        self.pool.admit(engines)
        return result

    # ---- syncs ------------------------------------------------------------------------------
    def sync_due(self, step: int) -> bool:
        """The mode's cadence: a sync falls due after `step` (the step loop's schedule asks)."""
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
        """The trainer half of a sync: take the pool's turn (waiting for the previous sync to
        finish), write the weights, score the probe with them. `finish_sync` must follow."""
        await self.pool.turn.acquire()
        began = time.perf_counter()
        new_version = self.policy.version + 1
        try:
            self._fire("SYNC")
            try:
                phases: dict[str, float] = {}
                with timed(phases, "save"):
                    staged = await self._save(new_version)
                reference = await self._trainer_scores(phases) if self.pipelined else None
                self._fire("SAVED")
            except OSError as exc:  # disk full, read-only, I/O error: no engine was touched
                self._fire("NOT_SAVED", error=str(exc))
                raise SyncNotSaved(f"sync to version {new_version} not written: {exc}") from exc
            except Exception as exc:
                raise self._failed(f"sync to version {new_version} failed: {exc}") from exc
        except BaseException:
            self.pool.turn.release()
            raise
        return StagedSync(new_version, staged, reference, phases, began, forced)

    async def finish_sync(self, sync: StagedSync) -> SyncRecord:
        """The engines' half: apply the staged weights to each member (recovering one that dies
        meanwhile), then probe them. Lets go of the pool's turn."""
        try:
            phases, new_version = sync.phases, sync.version
            try:
                with timed(phases, "apply"):
                    await self._apply_engines(sync.staged, new_version, phases)
                    self.pool.mark_current(self.pool.members(), new_version)
                    await self._applied(sync.staged, new_version)
                self.policy.publish(new_version, self._served_name())
                self._fire("APPLIED")
            except Exception as exc:
                raise self._failed(f"sync to version {new_version} failed: {exc}") from exc
            if sync.reference is None:  # not pipelined: the trainer's weights now are the synced ones
                sync.reference = await self._trainer_scores(phases)
            if self.probes.due():
                with timed(phases, "probe"):
                    probe = (await self._probe_and_serve(sync.reference)).as_dict()
            else:
                self.probes.skipped(sync.version, sync.reference)
                self._fire("PROBE_SKIP")
                self.pool.admit(self.pool.members())
                probe = {"skipped": True, "syncs_since_probe": self.probes.unprobed}
            record = SyncRecord(new_version, phases, time.perf_counter() - sync.began, probe, sync.forced)
            self.stats.add(record)
            log.info("sync_done", bridge=self.mode, **record.as_dict())
            return record
        finally:
            self.pool.turn.release()

    async def _trainer_scores(self, phases: dict[str, float]) -> list[list[float]]:
        """The trainer's probe scores of its weights now (in the trainer's task: a sync's)."""
        with timed(phases, "score"):
            return await anyio.to_thread.run_sync(trainer_scores, self.trainer)

    async def settled(self) -> None:
        """Return once no sync is in flight (a staged one has finished). Bounded by the sync's
        own request, probe and launch timeouts."""
        async with self.pool.turn:
            pass

    async def _apply_engines(self, staged: Any, version: int, phases: dict[str, float]) -> None:
        """Make every member serve `staged` as `version`, one after the other (a mode that
        updates them all at once overrides this). One that dies meanwhile leaves the pool, or,
        the only engine, is relaunched and the sync applied to it once more."""
        for engine in self.pool.members():
            try:
                await self._apply(engine, staged, version, phases)
            except Exception as exc:  # noqa: BLE001 — a dead engine is recovered, anything else fails the sync
                if not await self._meet_dead([engine], exc, version, phases):
                    raise
                if not engine.recovering:
                    await self._apply(engine, staged, version, phases)

    async def watch(self) -> None:
        """Every engine's health watch, each recovering its engine when lost (BridgeFailed: one cannot be)."""
        await self.pool.watch()

    async def recover(self, engine: InferenceEngine, reason: str) -> None:
        await self.pool.recover(engine, reason)  # what a watch does with a lost engine, now

    async def stop(self) -> None:
        if self.machine.can_fire(self.Event["STOP"]):
            self._fire("STOP")
        await self.pool.stop()
        if self.machine.can_fire(self.Event["STOPPED"]):
            self._fire("STOPPED")

    def describe(self) -> dict[str, Any]:
        last = self.stats.last_sync.as_dict() if self.stats.last_sync else None
        return {"mode": self.mode, "policy_version": self.policy.version, "syncs": self.stats.syncs,
                "sync_latency": self.stats.histogram(), "last_sync": last, "weights": str(self.current_weights),
                **self.pool.describe(), **self.machine.describe()}  # fmt: skip
