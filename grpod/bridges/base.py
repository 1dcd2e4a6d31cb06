"""What every bridge mode shares: the vLLM it serves through, the sync sequence, the probe.

A bridge owns the supervised inference process (launched through `grpod.inference`) and the one
question the rest of grpod asks it: "are vLLM's weights the trainer's, and which version are
they?". The supervisor calls `start`, `after_step(step)`, `sync_now`, `watch` (crash detection and
recovery), and `stop`. Every sync follows the same sequence, whatever the mode:

    SYNC → save (mode) → apply (mode) → version bump + prefix-cache reset → alignment probe

A sync is two halves. `stage_sync` is the trainer's: save, and score the probe sequences with the
saved weights. `finish_sync` is vLLM's: apply, and probe against those scores. Modes that ship a
copy (`pipelined`) let the supervisor train the next step between the halves; one sync is in
flight at a time (the next one, `recover` and `settled` wait for it). `bridge.probe_every` probes
only every N-th sync (always the first after a launch).

Each mode's module holds only what is particular to it: its states, events, transition table and
its `_save` / `_apply` / `_launch_args` pieces.

A dead vLLM is met in one of two places, and both spend the same restart budget
(`inference.max_restarts`):

- between syncs, by `watch` (`/health` failing `inference.health_failures` times, or the process
  group gone): vLLM is relaunched on the weights of the current policy version and probed against
  the trainer's scores recorded at that version's sync — the trainer may have stepped since, and
  its live weights are neither read nor compared;
- during a sync, by the sync itself (the apply step fails and vLLM does not answer `/health`):
  vLLM is relaunched on the weights it served before the sync and the same sync is applied once
  more, ending with the usual probe against the trainer. A second failure, or a failure while vLLM
  is healthy (e.g. it refused the weights), is FAILED.
"""

from __future__ import annotations

import enum
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import anyio
import structlog

from grpod.bridges.machine import StateMachine
from grpod.bridges.probe import ProbeMismatch, ProbeResult, ProbeTolerance, run_probe, trainer_scores
from grpod.config import GrpodConfig
from grpod.inference.client import InferenceClient
from grpod.inference.process import InferenceProcess

log = structlog.get_logger(__name__)


class BridgeFailed(RuntimeError):
    """The bridge cannot keep vLLM's weights in step; training must stop (checkpoint first)."""


class InferenceUnavailable(RuntimeError):
    """vLLM did not become available to serve requests in time."""


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
    apply reads them, and `reference` holds the trainer's probe scores of those weights. Nothing
    in it reads the trainer again, so the trainer may step while vLLM applies it."""

    version: int
    staged: Path
    reference: list[list[float]] | None  # None: the mode is not pipelined, probe the live trainer
    phases: dict[str, float]
    began: float
    forced: bool


@dataclass
class BridgeStats:
    syncs: int = 0
    restarts: int = 0
    last_sync: SyncRecord | None = None
    sync_seconds: list[float] = field(default_factory=list)


class Bridge:
    mode: ClassVar[str]
    # Whether a sync can be split into `stage_sync` (trainer half) and `finish_sync` (vLLM half)
    # with training going on in between: true when the mode ships vLLM a copy of the weights.
    pipelined: ClassVar[bool] = True
    State: ClassVar[type[enum.Enum]]
    Event: ClassVar[type[enum.Enum]]
    TABLE: ClassVar[dict]

    def __init__(self, cfg: GrpodConfig, run_dir: Path, trainer, *, policy_version: int = 0) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.trainer = trainer
        self.policy_version = policy_version
        self.inference = InferenceProcess(cfg.inference, cfg.model, run_dir)
        self.client: InferenceClient | None = None
        self.machine = StateMachine(self.mode, self.TABLE, self.State["IDLE"])
        self.stats = BridgeStats()
        self.weights_root = run_dir / "weights"
        self.current_weights: Path = cfg.model.path
        self._available = anyio.Event()
        # One sync at a time, from stage to finish (a semaphore: the finishing task is not
        # always the one that staged); recovery between syncs takes it too.
        self._sync_slot = anyio.Semaphore(1)
        # The trainer's probe scores at the last passed probe, and the policy version they are of.
        self._reference: tuple[int, list[list[float]]] | None = None
        # `bridge.probe_every`: syncs served without a probe since the last one, and whether
        # vLLM was (re)launched since (a launched vLLM is always probed).
        self._unprobed_syncs = 0
        self._launched_since_probe = True

    # ---- state machine -------------------------------------------------------------------
    def _fire(self, event: str, error: str | None = None) -> None:
        self.machine.fire(self.Event[event], error=error)

    @property
    def state(self) -> str:
        return self.machine.state.name

    # ---- availability gate: requests wait on it while vLLM is being replaced --------------
    def _open(self) -> None:
        self._available.set()

    def _close(self) -> None:
        if self._available.is_set():
            self._available = anyio.Event()

    @property
    def available(self) -> bool:
        return self._available.is_set()

    async def wait_available(self, timeout_s: float) -> InferenceClient:
        try:
            with anyio.fail_after(timeout_s):
                while True:
                    event = self._available
                    await event.wait()
                    if event is self._available and self.client is not None:
                        return self.client
        except TimeoutError:
            raise InferenceUnavailable(
                f"vLLM not available for {timeout_s:.0f}s (bridge state {self.state})"
            ) from None

    def request_model(self) -> str:
        """The model name requests must use to get the current policy."""
        return "policy"

    # ---- lifecycle shared by all modes ----------------------------------------------------
    def _launch_kwargs(self) -> dict[str, Any]:
        return {}

    async def _launch(self, weights: Path) -> None:
        await self.inference.start(weights, **self._launch_kwargs())
        self.client = self.inference.client()
        await self.client.__aenter__()
        await self.client.update_weight_version(self.policy_version)

    async def _shutdown_inference(self) -> None:
        self._close()
        if self.client is not None:
            client, self.client = self.client, None
            await client.__aexit__(None, None, None)
        await self.inference.stop()

    async def _initial_weights(self, resumed: bool) -> Path:
        """Where vLLM loads its first weights from: the model, or the resumed trainer's weights."""
        if not resumed:
            return self.cfg.model.path
        return await self._save_version_dir()

    async def _save_version_dir(self) -> Path:
        return await self._write_weights(self.weights_root / f"v{self.policy_version:06d}")

    async def _write_weights(self, target: Path) -> Path:
        if target.exists():
            shutil.rmtree(target)
        await anyio.to_thread.run_sync(self.trainer.save_weights, target)
        return target

    def _prune_weights(self, keep: int) -> None:
        if not self.weights_root.exists():
            return
        dirs = sorted(p for p in self.weights_root.iterdir() if p.is_dir())
        for old in dirs[:-keep]:
            if old != self.current_weights:
                shutil.rmtree(old, ignore_errors=True)

    async def start(self, *, resumed: bool = False) -> ProbeResult:
        self._fire("START")
        self.current_weights = await self._initial_weights(resumed)
        await self._launch(self.current_weights)
        self._fire("READY")
        return await self._probe_and_serve()

    async def _probe_and_serve(self, reference: list[list[float]] | None = None) -> ProbeResult:
        """Probe vLLM against `reference` (trainer scores taken earlier: at a sync's staging, or
        at the current version's sync for a relaunch between syncs), else the trainer's live
        weights."""
        assert self.client is not None
        result = await run_probe(
            self.client,
            self.trainer,
            model=self.request_model(),
            tolerance=ProbeTolerance.for_serving(self.cfg.model.dtype, self.cfg.bridge),
            timeout_s=self.cfg.bridge.probe_timeout_s,
            reference=reference,
        )
        if not result.ok:
            message = (
                f"alignment probe failed: vLLM's logprobs differ from the trainer's by up to "
                f"{result.max_abs_diff:.4g} (mean {result.mean_abs_diff:.4g}, p95 {result.p95_abs_diff:.4g}; "
                f"tolerance {result.tolerance.describe()}); vLLM is not serving the "
                f"trainer's weights (policy version {self.policy_version})"
            )
            self._fire("PROBE_FAIL", error=message)
            raise ProbeMismatch(message)
        self._fire("PROBE_OK")
        self._launched_since_probe, self._unprobed_syncs = False, 0
        self._reference = (self.policy_version, result.reference)
        self._open()
        return result

    def sync_due(self, step: int) -> bool:
        return step % self.cfg.bridge.sync_every == 0

    async def after_step(self, step: int) -> SyncRecord | None:
        return await self.sync_now() if self.sync_due(step) else None

    async def sync_now(self, *, forced: bool = False) -> SyncRecord:
        """A whole sync: vLLM serves the trainer's weights as the next version when it returns."""
        return await self.finish_sync(await self.stage_sync(forced=forced))

    async def stage_sync(self, *, forced: bool = False) -> StagedSync:
        """The trainer half of a sync: take the sync slot (waiting for the previous sync to
        finish), write the weights, score the probe with them. `finish_sync` must follow."""
        await self._sync_slot.acquire()
        began = time.perf_counter()
        new_version = self.policy_version + 1
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
        """The vLLM half: apply the staged weights (recovering a vLLM that dies meanwhile), then
        probe them against the scores taken when they were staged. Releases the sync slot."""
        try:
            phases, new_version = sync.phases, sync.version
            try:
                t = time.perf_counter()
                try:
                    await self._apply(sync.staged, new_version, phases)
                except Exception as exc:  # noqa: BLE001 — a dead vLLM is recovered, anything else fails below
                    if await self._engine_healthy():
                        raise
                    await self._relaunch_mid_sync(exc, new_version, phases)
                    await self._apply(sync.staged, new_version, phases)
                phases["apply"] = time.perf_counter() - t
                self.policy_version = new_version
                self._fire("APPLIED")
            except Exception as exc:
                message = f"sync to version {new_version} failed: {exc}"
                self._fire("FAIL", error=message)
                raise BridgeFailed(message) from exc
            t = time.perf_counter()
            if self._probe_due():
                probe = (await self._probe_and_serve(sync.reference)).as_dict()
                phases["probe"] = time.perf_counter() - t
            else:
                probe = self._serve_unprobed(sync)
            record = SyncRecord(new_version, phases, time.perf_counter() - sync.began, probe, sync.forced)
            self.stats.syncs += 1
            self.stats.last_sync = record
            self.stats.sync_seconds.append(record.total_s)
            log.info("sync_done", bridge=self.mode, **record.as_dict())
            return record
        finally:
            self._sync_slot.release()

    def _probe_due(self) -> bool:
        """Every `bridge.probe_every`-th sync is probed, and always the first after a launch."""
        return self._launched_since_probe or self._unprobed_syncs + 1 >= self.cfg.bridge.probe_every

    def _serve_unprobed(self, sync: StagedSync) -> dict[str, Any]:
        self._unprobed_syncs += 1
        self._fire("PROBE_SKIP")
        # Recovery before the next probe compares a relaunched vLLM with this version's scores.
        self._reference = (sync.version, sync.reference) if sync.reference is not None else None
        self._open()
        return {"skipped": True, "syncs_since_probe": self._unprobed_syncs}

    async def settled(self) -> None:
        """Return once no sync is in flight (a staged one has finished). Bounded by the sync's
        own request, probe and launch timeouts."""
        async with self._sync_slot:
            pass

    async def _bump_version_and_reset_cache(self, version: int) -> None:
        """Every weight change: the new version on vLLM's tokens, and no cached old-weight prefixes."""
        assert self.client is not None
        await self.client.reset_prefix_cache()
        await self.client.update_weight_version(version)

    async def _save(self, version: int) -> Path:
        """Write what this mode ships to vLLM for `version`; returns where it is."""
        raise NotImplementedError

    async def _apply(self, staged: Path, version: int, phases: dict[str, float]) -> None:
        """Make vLLM serve `staged` as `version` (including cache reset and version bump)."""
        raise NotImplementedError

    async def _relaunch(self, weights: Path, phases: dict[str, float] | None = None) -> None:
        """Stop vLLM, wait until it released everything, launch it on `weights`, wait ready."""
        t = time.perf_counter()
        await self._shutdown_inference()
        if phases is not None:
            phases["stop"] = time.perf_counter() - t
        t = time.perf_counter()
        self._launched_since_probe = True
        await self._launch(weights)
        if phases is not None:
            phases["launch"] = time.perf_counter() - t

    # ---- crash detection and recovery -------------------------------------------------------
    async def _engine_healthy(self) -> bool:
        if not self.inference.running or self.client is None:
            return False
        try:
            with anyio.fail_after(self.cfg.inference.request_timeout_s):
                return await self.client.health()
        except Exception:  # noqa: BLE001 — any failure to answer is an unhealthy probe
            return False

    def _spend_restart(self, reason: str) -> None:
        """Count one relaunch after a crash; when the budget is spent, fail with the reason."""
        if self.stats.restarts >= self.cfg.inference.max_restarts:
            raise BridgeFailed(
                f"{reason}, and the restart budget (inference.max_restarts = {self.cfg.inference.max_restarts}) is spent"
            )
        self.stats.restarts += 1

    async def _relaunch_mid_sync(self, cause: Exception, version: int, phases: dict[str, float]) -> None:
        """vLLM died while a sync was applied: relaunch it on the weights it served before the
        sync (the caller then applies the sync again). No probe here: the trainer is already at
        `version`, vLLM is not yet."""
        began = time.perf_counter()
        reason = f"vLLM died during the sync to version {version} ({type(cause).__name__}: {cause})"
        self._spend_restart(reason)
        self._fire("LOST", error=reason)
        log.warning("inference_lost", bridge=self.mode, pid=self.inference.pid, restarts=self.stats.restarts, during="sync", error=str(cause))
        await self._relaunch(self.current_weights)
        self._fire("RETRY")
        phases["recover"] = time.perf_counter() - began
        log.info("inference_recovered", bridge=self.mode, seconds=round(phases["recover"], 3), during="sync")

    async def watch(self) -> None:
        """Probe vLLM while it serves; after `health_failures` failed probes, recover it."""
        failures = 0
        backoff = 1.0
        while True:
            await anyio.sleep(self.cfg.inference.health_interval_s)
            if self.machine.state != self.State["SERVING"] or self._sync_slot.value == 0:
                failures = 0
                continue
            if await self._engine_healthy():
                failures = 0
                continue
            failures += 1
            if failures < self.cfg.inference.health_failures:
                continue
            failures = 0
            if self.stats.restarts:
                await anyio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)
            await self.recover()

    async def recover(self) -> None:
        """Relaunch a dead vLLM on the current version's weights and probe it against that
        version's reference scores (a sync that ran meanwhile may already have recovered it)."""
        async with self._sync_slot:
            if self.machine.state != self.State["SERVING"] or await self._engine_healthy():
                return
            began = time.perf_counter()
            reason = "inference engine dead or unresponsive"
            try:
                self._spend_restart(reason)
            except BridgeFailed as exc:
                self._fire("FAIL", error=str(exc))
                raise
            self._fire("LOST", error=reason)
            log.warning("inference_lost", bridge=self.mode, pid=self.inference.pid, restarts=self.stats.restarts)
            await self._relaunch(self.current_weights)
            self._fire("RECOVERED")
            reference = self._reference[1] if self._reference and self._reference[0] == self.policy_version else None
            await self._probe_and_serve(reference)
            log.info("inference_recovered", bridge=self.mode, seconds=round(time.perf_counter() - began, 3))

    async def stop(self) -> None:
        if self.machine.can_fire(self.Event["STOP"]):
            self._fire("STOP")
        await self._shutdown_inference()
        if self.machine.can_fire(self.Event["STOPPED"]):
            self._fire("STOPPED")

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "policy_version": self.policy_version,
            "syncs": self.stats.syncs,
            "restarts": self.stats.restarts,
            "last_sync": self.stats.last_sync.as_dict() if self.stats.last_sync else None,
            "weights": str(self.current_weights),
            "vllm": {
                "pid": self.inference.pid,
                "running": self.inference.running,
                "base_url": self.inference.base_url if self.inference.running else None,
                "available": self.available,
            },
            **self.machine.describe(),
        }
