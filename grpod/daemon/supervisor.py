"""The grpod supervisor: one anyio task group that owns everything a run does.

    Daemon.run
    └── task group
        ├── control socket server          (answers while a step runs)
        ├── signals (SIGTERM/SIGINT → stop, SIGHUP → reload safe settings)
        ├── systemd watchdog               (WATCHDOG=1 only while steps progress)
        ├── bridge.watch                   (vLLM health; crash → recover)
        ├── fetch (overlap mode)           (source → RolloutBuffer)
        └── train loop (this task)         (buffer → validate → staleness → step in a thread
                                            → bridge sync → checkpoint / eval at boundaries)

Every way a run ends (steps done, `ctl stop`, `ctl drain`, SIGTERM, a failed bridge) goes through
`_shutdown`: stop fetching, let the running step finish (its thread is never abandoned), final
evaluation, final checkpoint, stop vLLM and wait until it released everything, STOPPING=1.
Operator requests (pause, sync, checkpoint) take effect at the next step boundary — or at once
when the trainer is idle waiting for data.
"""

from __future__ import annotations

import enum
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup
import structlog

from grpod.bridges import make_bridge
from grpod.bridges.base import BridgeFailed, StagedSync, SyncRecord
from grpod.config import ConfigError, GrpodConfig, load_config
from grpod.daemon.alarms import LogprobGapAlarm, SourceErrorAlarm
from grpod.daemon.control import ControlError, ControlServer
from grpod.daemon.live import LIVE_KEYS, SettingChange, diff_file, plan_changes
from grpod.daemon.logs import MetricsLog, WandbSink, configure_logging
from grpod.daemon.notify import Heartbeat, SystemdNotifier, watchdog_interval_s
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.duplicates import DuplicateWindow
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.replay import record_groups
from grpod.rollouts.rewards import step_reward_metrics
from grpod.rollouts.staleness import StalenessStats, apply_staleness
from grpod.rollouts.validation import RejectionCounter, record_rejection, validate_batch

log = structlog.get_logger(__name__)


# How often the source alarm looks at the source, and refreshes the systemd STATUS line while up.
SOURCE_CHECK_S = 1.0
SOURCE_STATUS_S = 10.0


class RunPhase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"


class RunDirError(Exception):
    """The run directory is unusable or unsafe."""


@dataclass
class PendingRequest:
    """An operator request served at the next step boundary; the control reply waits for it."""

    kind: str
    done: anyio.Event = field(default_factory=anyio.Event)
    result: dict[str, Any] | None = None
    error: str | None = None


def prepare_run_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise RunDirError(f"run directory {path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


class Daemon:
    def __init__(self, cfg: GrpodConfig, *, config_path: Path | None = None) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.run_dir = cfg.run.dir
        self.phase = RunPhase.STARTING
        self.step = 0  # batches consumed (train.steps counts these)
        self.trained_steps = 0  # batches that took an optimizer update
        self.skipped_batches = 0  # batches that trained nothing (all rejected, zero-variance, non-finite)
        self.exit_code = 0
        self.stop_reason: str | None = None
        self.paused = False
        self.draining = False
        self.buffer = RolloutBuffer(max(cfg.source.prefetch_groups, cfg.train.groups_per_step))
        self.rejections = RejectionCounter()
        self.duplicates = DuplicateWindow()
        self.logprob_gap = LogprobGapAlarm(cfg.train.logprob_gap_alarm)
        self.source_alarm = SourceErrorAlarm(cfg.source.error_alarm_s, cfg.source.fail_after_s)
        self.staleness = StalenessStats()
        self.heartbeat = Heartbeat(cfg.notify.stall_after_s)
        self.notifier = SystemdNotifier()
        self.pending: list[PendingRequest] = []
        self.last_metrics: dict[str, Any] = {}
        self._work: TaskGroup | None = None  # the step loop's task group (fetch, pipelined syncs)
        self.last_eval: dict[str, Any] = {}
        self.last_checkpoint: dict[str, Any] | None = None
        self.config_changes: list[dict[str, Any]] = []
        self.pending_changes: list[tuple[SettingChange, str]] = []
        self.started_at = time.time()
        self._wait_scope: anyio.CancelScope | None = None
        self._fetch_scope: anyio.CancelScope | None = None
        self._stop_requested = False
        # Set while components start (cancelled by a stop request); _started once they have.
        self._start_scope: anyio.CancelScope | None = None
        self._started = False
        self.source_exhausted = False
        self.trainer = None
        self.bridge = None
        self.source = None

    # ---- operator requests --------------------------------------------------------------
    def _wake(self) -> None:
        if self._wait_scope is not None:
            self._wait_scope.cancel()

    def request_stop(self, reason: str) -> None:
        if not self._stop_requested:
            log.info("stop_requested", reason=reason, step=self.step, phase=self.phase.value)
            self._stop_requested = True
            self.stop_reason = reason
        if self._start_scope is not None:
            self._start_scope.cancel()
        self._wake()

    async def _boundary_request(self, kind: str) -> dict[str, Any]:
        if self._stop_requested:
            raise ControlError("the daemon is stopping")
        request = PendingRequest(kind)
        self.pending.append(request)
        self._wake()
        await request.done.wait()
        if request.error:
            raise ControlError(request.error)
        return request.result or {}

    async def _ctl_status(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.status()

    async def _ctl_pause(self, args: dict[str, Any]) -> dict[str, Any]:
        self.paused = True
        log.info("paused", step=self.step)
        return {"paused": True, "effective": "at the next step boundary", "step": self.step}

    async def _ctl_resume(self, args: dict[str, Any]) -> dict[str, Any]:
        was = self.paused
        self.paused = False
        self._wake()
        log.info("resumed", step=self.step)
        return {"paused": False, "was_paused": was, "step": self.step}

    async def _ctl_sync(self, args: dict[str, Any]) -> dict[str, Any]:
        return await self._boundary_request("sync")

    async def _ctl_checkpoint(self, args: dict[str, Any]) -> dict[str, Any]:
        return await self._boundary_request("checkpoint")

    async def _ctl_drain(self, args: dict[str, Any]) -> dict[str, Any]:
        self.draining = True
        if self._fetch_scope is not None:
            self._fetch_scope.cancel()
        self._wake()
        log.info("drain_requested", buffered=len(self.buffer), step=self.step)
        return {"draining": True, "buffered_groups": len(self.buffer), "step": self.step}

    async def _ctl_set(self, args: dict[str, Any]) -> dict[str, Any]:
        key, value = args.get("key"), args.get("value")
        if not isinstance(key, str) or "value" not in args:
            raise ControlError('expected args {"key": "train.lr", "value": 1e-5}')
        try:
            _, changes = plan_changes(self.cfg, {key: value}, "ctl set")
        except ConfigError as exc:
            raise ControlError(str(exc)) from None
        self.pending_changes.extend((change, "ctl set") for change in changes)
        self._wake()
        return {
            "accepted": [vars(c) for c in changes],
            "effective": "at the next step boundary",
            "unchanged": not changes,
        }

    def _reload_config_file(self) -> None:
        """SIGHUP: re-read the config file; apply the live subset, refuse the rest (logged)."""
        if self.config_path is None:
            log.warning("reload_refused", reason="the daemon was started without --config")
            return
        try:
            reloaded = load_config(self.config_path)
            wanted = diff_file(self.cfg, reloaded)
            refused = sorted(key for key in wanted if key not in LIVE_KEYS)
            live = {key: value for key, value in wanted.items() if key in LIVE_KEYS}
            _, changes = plan_changes(self.cfg, live, f"SIGHUP {self.config_path}")
        except ConfigError as exc:
            log.error("reload_refused", path=str(self.config_path), reason=str(exc))
            return
        if refused:
            log.warning(
                "reload_refused",
                path=str(self.config_path),
                keys=refused,
                reason="these keys cannot change while running (restart grpod to apply them)",
            )
        log.info("reload_accepted", path=str(self.config_path), changes=[vars(c) for c in changes])
        self.pending_changes.extend((change, "SIGHUP") for change in changes)
        self._wake()

    def _apply_changes(self) -> None:
        """At a step boundary: apply accepted live changes to the running config and the trainer."""
        while self.pending_changes:
            change, origin = self.pending_changes.pop(0)
            *sections, leaf = change.key.split(".")
            node = self.cfg
            for part in sections:
                node = getattr(node, part)
            setattr(node, leaf, change.new)
            if change.key == "train.lr":
                self.trainer.set_learning_rate(change.new)
            record = {"version": len(self.config_changes) + 1, "step": self.step, "origin": origin, **vars(change)}
            self.config_changes.append(record)
            log.info("config_changed", **record)

    async def _ctl_stop(self, args: dict[str, Any]) -> dict[str, Any]:
        self.request_stop("ctl stop")
        return {"stopping": True, "step": self.step}

    def handlers(self) -> dict[str, Any]:
        return {
            "status": self._ctl_status,
            "pause": self._ctl_pause,
            "resume": self._ctl_resume,
            "sync": self._ctl_sync,
            "checkpoint": self._ctl_checkpoint,
            "drain": self._ctl_drain,
            "set": self._ctl_set,
            "stop": self._ctl_stop,
        }

    # ---- status -------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        bridge = self.bridge.describe() if self.bridge is not None else None
        return {
            "schema": 1,
            "state": self.phase.value,
            "step": self.step,
            "steps": self.cfg.train.steps,
            "trained_steps": self.trained_steps,
            "skipped_batches": self.skipped_batches,
            "paused": self.paused,
            "draining": self.draining,
            "policy_version": self.bridge.policy_version if self.bridge else None,
            "bridge": bridge,
            "queue_depth": len(self.buffer),
            "accepted_groups": self.buffer.accepted,
            "rejected": self.rejections.as_dict(),
            "inference": self.inference_endpoint(),
            "alarms": {"logprob_gap": self.logprob_gap.describe(), "source": self.source_alarm.describe()},
            "staleness": self.staleness.as_dict(),
            "source": self._source_status(),
            "heartbeat": self.heartbeat.describe(),
            "last_metrics": self.last_metrics,
            "last_eval": self.last_eval,
            "last_checkpoint": self.last_checkpoint,
            "config_changes": self.config_changes[-10:],
            "run_dir": str(self.run_dir),
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 1),
            "stop_reason": self.stop_reason,
        }

    def _source_status(self) -> dict[str, Any] | None:
        if self.source is None:
            return None
        stats = self.source.stats
        return {"kind": self.source.kind, "cursor": self.source.cursor(), **vars(stats)}

    # ---- the run --------------------------------------------------------------------------
    async def run(self) -> int:
        prepare_run_dir(self.run_dir)
        configure_logging(self.run_dir, self.cfg.run.log_level)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl")
        log.info("daemon_starting", run_dir=str(self.run_dir), mode=self.cfg.bridge.mode, pid=os.getpid())
        from grpod.daemon.state import RunStore  # the trainer stack imports torch: keep start-up errors fast

        self.store = RunStore(self.cfg, self.run_dir)
        control = ControlServer(self.cfg.socket_path, self.handlers(), self.cfg.control.request_timeout_s)
        try:
            async with anyio.create_task_group() as tg:
                if self.cfg.metrics.wandb_project:
                    self.metrics.wandb = await anyio.to_thread.run_sync(self._wandb_sink)
                await tg.start(control.serve)
                if self.cfg.metrics.prometheus_port is not None:
                    from grpod.daemon.exporter import serve_metrics

                    await tg.start(serve_metrics, self, self.cfg.metrics.prometheus_host, self.cfg.metrics.prometheus_port)
                tg.start_soon(self._signals)
                # A stop (signal, `ctl stop`/`drain`) cancels the start-up at once: loading the
                # trainer finishes (its thread is not abandoned), a launching vLLM is stopped.
                with anyio.CancelScope() as self._start_scope:
                    if self._stop_requested:
                        self._start_scope.cancel()
                    await self._start_components()
                    self._started = True
                self._start_scope = None
                if self._started and not self._stop_requested:
                    tg.start_soon(self._watchdog)
                    tg.start_soon(self._watch_bridge)
                    tg.start_soon(self._watch_source)
                    self._announce_inference()
                    self.notifier.ready(f"step {self.step}/{self.cfg.train.steps}, vLLM ready")
                    await self._evaluate("start")
                    self.phase = RunPhase.RUNNING
                    try:
                        async with anyio.create_task_group() as work:
                            self._work = work
                            if self.cfg.source.overlap:
                                work.start_soon(self._fetch)
                            await self._train_loop()
                            work.cancel_scope.cancel()
                    except* BridgeFailed as failed:  # anyio task groups always raise ExceptionGroups
                        self._fail(f"bridge failed: {failed.exceptions[0]}")
                elif not self._started:
                    self.stop_reason = f"{self.stop_reason} during start-up"
                    log.info("start_cancelled", reason=self.stop_reason)
                await self._shutdown()
                tg.cancel_scope.cancel()
        except BaseException as exc:
            failure = _unwrap(exc)
            if failure is None:
                raise
            self._fail(f"{type(failure).__name__}: {failure}")
            with anyio.CancelScope(shield=True):
                await self._emergency_stop()
        finally:
            self.notifier.close()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.metrics.close)
        self.phase = RunPhase.STOPPED
        log.info("daemon_stopped", step=self.step, exit_code=self.exit_code, reason=self.stop_reason)
        return self.exit_code

    def _wandb_sink(self) -> WandbSink:
        m = self.cfg.metrics
        return WandbSink(m.wandb_project, m.wandb_entity, m.wandb_mode, self.run_dir, self.cfg.model_dump(mode="json"))

    def _fail(self, reason: str) -> None:
        log.error("run_failed", reason=reason, step=self.step)
        self.exit_code = 1
        self.stop_reason = reason
        self._stop_requested = True

    async def _start_components(self) -> None:
        restored = await anyio.to_thread.run_sync(self.store.load_trainer)
        self.trainer = restored.trainer
        self.step = restored.step
        counts = restored.extra.get("step_counts", {})
        self.trained_steps = int(counts.get("trained", restored.step))
        self.skipped_batches = int(counts.get("skipped", 0))
        self.buffer.restore(restored.buffered)
        self.bridge = make_bridge(self.cfg, self.run_dir, self.trainer, policy_version=restored.policy_version)
        # In a worker thread: the dataset source reads and tokenizes its whole file here.
        self.source = await anyio.to_thread.run_sync(
            lambda: self.store.make_source(
                self.trainer.tokenizer, self.bridge, restored.source_cursor, rejections=self.rejections
            )
        )
        if restored.checkpoint is not None:
            log.info(
                "resumed",
                checkpoint=str(restored.checkpoint),
                step=self.step,
                policy_version=restored.policy_version,
                buffered_groups=len(restored.buffered),
            )
        self.heartbeat.busy()
        await self.bridge.start(resumed=restored.checkpoint is not None)
        self.heartbeat.progress()

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    self._reload_config_file()
                    continue
                self.request_stop(signal.Signals(signum).name)

    async def _watchdog(self) -> None:
        interval = watchdog_interval_s() if self.cfg.notify.watchdog else None
        if interval is None:
            return
        while True:
            if self.heartbeat.healthy():
                self.notifier.watchdog()
                self.heartbeat.last_ping = time.monotonic()
            else:
                log.warning("watchdog_withheld", **self.heartbeat.describe())
            await anyio.sleep(interval)

    async def _watch_bridge(self) -> None:
        try:
            await self.bridge.watch()
        except BridgeFailed as exc:
            self._fail(f"bridge failed: {exc}")
            self._wake()

    async def _watch_source(self) -> None:
        """Raise and clear the source alarm; end the run after `source.fail_after_s` of failures.
        While the alarm is up the systemd STATUS line says so (refreshed each SOURCE_STATUS_S)."""
        last_status = 0.0
        while True:
            await anyio.sleep(SOURCE_CHECK_S)
            if self.source is None:
                continue
            was_active = self.source_alarm.active
            reason = self.source_alarm.check(self.source.stats, time.time())
            if reason is not None:
                self._fail(reason)
                self._wake()
                return
            now = time.monotonic()
            if self.source_alarm.active and (not was_active or now - last_status >= SOURCE_STATUS_S):
                self.notifier.status(f"ALARM step {self.step}/{self.cfg.train.steps}: {self.source_alarm.summary()[:200]}")
                last_status = now
            elif was_active and not self.source_alarm.active:
                self.notifier.status(f"step {self.step}/{self.cfg.train.steps}, source delivering again")

    async def _may_generate(self) -> None:
        if self.paused:
            await self._until(lambda: not self.paused)

    async def _fetch(self) -> None:
        with anyio.CancelScope() as scope:
            self._fetch_scope = scope
            if self.draining:
                return
            await self.source.run(self.buffer, self._may_generate)
            # Only a finite source (replay) returns: the run ends once the buffer is used up.
            self.source_exhausted = True
            self._wake()

    async def _until(self, condition, timeout_s: float = 1.0) -> None:
        """Wait until `condition()` holds; re-checked whenever `_wake` is called or each timeout_s."""
        while not condition() and not self._stop_requested:
            with anyio.CancelScope() as scope:
                self._wait_scope = scope
                await anyio.sleep(timeout_s)
            self._wait_scope = None

    async def _next_groups(self) -> list[RolloutGroup] | None:
        """The next step's groups, or None when the run should end (stop, or drained)."""
        n = self.cfg.train.groups_per_step
        while not self._stop_requested:
            await self._serve_pending()
            if self.paused:
                await self._until(lambda: not self.paused or bool(self.pending) or bool(self.pending_changes))
                continue
            if self.draining or (self.source_exhausted and len(self.buffer) < n):
                groups = await self.buffer.take_available(n)
                return groups or None
            if not self.cfg.source.overlap and len(self.buffer) < n:
                await self.source.fill(self.buffer, n - len(self.buffer))
                self.source_exhausted = getattr(self.source.stats, "exhausted", False)
                continue
            with anyio.CancelScope() as scope:
                self._wait_scope = scope
                groups = await self.buffer.take(n)
                self._wait_scope = None
                return groups
            self._wait_scope = None
        return None

    async def _train_loop(self) -> None:
        while self.step < self.cfg.train.steps and not self._stop_requested:
            groups = await self._next_groups()
            if groups is None:
                break
            await self._train_one(groups)
            await self._serve_pending()
            if self.cfg.checkpoint.every and self.step % self.cfg.checkpoint.every == 0:
                await self._checkpoint()
            if self.cfg.eval.every and self.step % self.cfg.eval.every == 0 and self.step < self.cfg.train.steps:
                await self.bridge.settled()
                await self._evaluate("periodic")
        await self.bridge.settled()
        if self.step > 0 and self.trained_steps == 0 and not self._stop_requested:
            self._fail(
                f"no step trained: all {self.skipped_batches} batches were skipped (every group rejected, "
                "zero-variance or with a non-finite gradient; `ctl status` shows the rejections)"
            )
        elif self.step >= self.cfg.train.steps:
            self.stop_reason = self.stop_reason or "steps done"
        elif self.draining and not self._stop_requested:
            self.stop_reason = "drained"
        elif self.source_exhausted and not self._stop_requested:
            self.stop_reason = "source exhausted"

    async def _train_one(self, groups: list[RolloutGroup]) -> None:
        started = time.perf_counter()
        valid, rejected = validate_batch(
            groups,
            vocab_size=self.trainer.vocab_size,
            max_seq_len=self.cfg.model.max_seq_len,
            group_normalised=self.cfg.train.advantages.scale != "none" or self.cfg.train.advantages.drop_zero_variance,
            # Groups without inference logprobs (an Atropos environment that sends none) train
            # with IS weight 1, counted as `is_uncorrected_tokens` (see training/loss.py).
            require_logprobs=False,
        )
        for _, rejection in rejected:
            self.rejections.add(rejection)
        fresh = []
        for group in valid:
            duplicate = self.duplicates.admit(group)
            if duplicate is None:
                fresh.append(group)
            else:
                record_rejection(group, duplicate, self.rejections)
                rejected.append((group, duplicate))
        version = self.bridge.policy_version
        trainable, ages = apply_staleness(
            fresh, version, self.cfg.train.max_staleness, self.cfg.train.stale_policy, self.staleness
        )
        if self.cfg.run.record_rollouts and trainable:
            # Only what reaches the trainer (a replay then trains exactly these).
            record_groups(self.run_dir / "rollouts.jsonl", self.step + 1, trainable)
        self.heartbeat.busy()
        if trainable:
            metrics = await anyio.to_thread.run_sync(self.trainer.train_step, trainable)
        else:
            metrics = {"skipped": 1}
            log.warning("step_skipped", reason="no valid group in the batch", rejected=len(rejected))
        self.step += 1
        if metrics.get("skipped"):
            self.skipped_batches += 1
        else:
            self.trained_steps += 1
        self.logprob_gap.observe(self.step, metrics)
        self.heartbeat.progress()
        train_s = time.perf_counter() - started
        sync, staged = None, None
        sync_began = time.perf_counter()
        self.heartbeat.busy()
        if self._sync_pending():
            sync = await self.bridge.sync_now(forced=True)
            self._complete_pending("sync", sync.as_dict())
        elif metrics.get("skipped"):
            pass
        elif self.cfg.source.overlap and self.bridge.pipelined and self.bridge.sync_due(self.step):
            # The trainer half now; vLLM applies and probes while the next step trains.
            staged = await self.bridge.stage_sync()
            self._work.start_soon(self._finish_sync, staged, self.step)
        else:
            sync = await self.bridge.after_step(self.step)
        self.heartbeat.progress()
        # Seconds this step spent on a sync: all of it, or its trainer half when pipelined.
        sync_s = time.perf_counter() - sync_began if sync or staged else None
        if sync is not None:
            self._record_sync(sync, self.step)
        record = {
            **metrics,
            "groups": len(groups),
            "rejected": len(rejected),
            "staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "staleness_max": max(ages) if ages else 0,
            "policy_version": self.bridge.policy_version,
            "train_s": round(train_s, 4),
            "step_s": round(time.perf_counter() - started, 4),
            "queue_depth": len(self.buffer),
            "group_ids": [g.group_id for g in trainable],
            "sync_s": round(sync_s, 4) if sync_s is not None else None,
            # The dataset source's reward functions, each one's mean over the step's groups.
            **step_reward_metrics(groups),
        }
        self.last_metrics = {k: v for k, v in record.items() if isinstance(v, (int, float, type(None)))}
        self.metrics.write("step", self.step, record)
        self._progress_line(record)
        self.notifier.status(f"step {self.step}/{self.cfg.train.steps} reward {record.get('reward_mean', 0):.3f}")

    async def _finish_sync(self, staged: StagedSync, step: int) -> None:
        with self.heartbeat.running():
            record = await self.bridge.finish_sync(staged)
        self._record_sync(record, step)

    def _record_sync(self, sync: SyncRecord, weights_step: int) -> None:
        """One `sync` line in metrics.jsonl per sync, written at the current step (W&B needs
        steps in order); `weights_step` is the step whose weights it carries."""
        self.metrics.write("sync", self.step, {**sync.as_dict(), "weights_step": weights_step})

    def inference_endpoint(self) -> dict[str, Any] | None:
        """Where environments reach the policy: vLLM's OpenAI base URL and the model names it serves."""
        inference = getattr(self.bridge, "inference", None)
        if inference is None or not inference.running:
            return None
        lora = self.cfg.bridge.mode in ("lora_only", "lora_restart")
        return {
            "base_url": f"{inference.base_url}/v1",
            "generate_url": f"{inference.base_url}/generate",
            "model_names": inference.served_model_names(lora=lora),
            "fixed_port": self.cfg.inference.port != 0,
        }

    def _announce_inference(self) -> None:
        endpoint = self.inference_endpoint()
        if endpoint is None:
            return
        log.info("inference_endpoint", **endpoint)
        if not self.cfg.run.progress:
            return
        names = ", ".join(endpoint["model_names"])
        lines = [f"grpod: vLLM serves the policy at {endpoint['base_url']} (model names: {names})"]
        if self.cfg.bridge.mode in ("lora_only", "lora_restart"):
            lines.append(
                f"grpod: LoRA mode: environments should call {endpoint['generate_url']} (Atropos server_type = vllm), "
                "which samples from the current adapter"
            )
        if not endpoint["fixed_port"]:
            lines.append("grpod: the port was picked at random; set inference.port for a URL environments can keep")
        print("\n".join(lines), file=sys.stderr, flush=True)

    def _progress_line(self, record: dict[str, Any]) -> None:
        if not self.cfg.run.progress:
            return
        elapsed = max(time.time() - self.started_at, 1e-6)
        loss = "skipped" if record.get("skipped") else f"{record.get('loss', float('nan')):+.4f}"
        line = (
            f"step {self.step:>4}/{self.cfg.train.steps}  reward {record.get('reward_mean', float('nan')):6.3f}  "
            f"loss {loss}  {self.step / elapsed:5.2f} steps/s  "
            f"v{self.bridge.policy_version} {self.bridge.state}"
        )
        if record.get("sync_s") is not None:
            line += f"  sync {record['sync_s'] * 1000:.0f} ms"
        print(line, file=sys.stderr, flush=True)

    def _sync_pending(self) -> bool:
        return any(r.kind == "sync" for r in self.pending)

    def _complete_pending(self, kind: str, result: dict[str, Any] | None = None, error: str | None = None) -> None:
        for request in [r for r in self.pending if r.kind == kind]:
            self.pending.remove(request)
            request.result, request.error = result, error
            request.done.set()

    async def _serve_pending(self) -> None:
        """Serve operator requests that wait for a step boundary (we are at one now)."""
        self._apply_changes()
        if self._sync_pending():
            try:
                record = await self.bridge.sync_now(forced=True)
            except BridgeFailed as exc:
                self._complete_pending("sync", error=str(exc))
                raise
            self._record_sync(record, self.step)
            self._complete_pending("sync", record.as_dict())
        if any(r.kind == "checkpoint" for r in self.pending):
            try:
                info = await self._checkpoint()
            except Exception as exc:  # noqa: BLE001 — reported to the operator, the run goes on
                log.exception("checkpoint_failed")
                self._complete_pending("checkpoint", error=f"checkpoint failed: {exc}")
            else:
                self._complete_pending("checkpoint", info)

    async def _checkpoint(self) -> dict[str, Any]:
        await self.bridge.settled()  # the checkpoint's policy version is the trainer's weights'
        self.heartbeat.busy()
        began = time.perf_counter()
        path = await anyio.to_thread.run_sync(
            self.store.save,
            self.trainer,
            self.step,
            self.bridge.policy_version,
            self.buffer.snapshot(),
            self.source.cursor(),
            {
                "rejections": self.rejections.as_dict(),
                "config_changes": self.config_changes,
                "step_counts": {"trained": self.trained_steps, "skipped": self.skipped_batches},
            },
        )
        self.heartbeat.progress()
        self.last_checkpoint = {"path": str(path), "step": self.step, "time": time.time()}
        seconds = time.perf_counter() - began
        log.info("checkpoint_written", path=str(path), step=self.step, seconds=round(seconds, 3))
        return {"path": str(path), "step": self.step, "seconds": round(seconds, 3)}

    async def _evaluate(self, when: str) -> None:
        if self.cfg.eval.size <= 0 or not hasattr(self.source, "evaluate"):
            return
        try:
            result = await self.source.evaluate(self.cfg.eval.size, self.cfg.eval.max_tokens)
        except Exception as exc:  # noqa: BLE001 — an evaluation failure is reported, not fatal
            log.warning("eval_failed", when=when, error=str(exc))
            return
        self.last_eval = {**result, "when": when, "step": self.step}
        self.metrics.write("eval", self.step, self.last_eval)
        log.info("eval", **self.last_eval)
        if self.cfg.run.progress:
            print(
                f"eval ({when}, step {self.step}): accuracy {result['eval_accuracy']:.3f}"
                + (f", mean@{result['eval_k']} {result['eval_mean_at_k']:.3f}" if "eval_mean_at_k" in result else "")
                + f" on {result['eval_size']} held-out problems",
                file=sys.stderr,
                flush=True,
            )

    async def _shutdown(self) -> None:
        self.phase = RunPhase.STOPPING
        self.notifier.stopping(f"stopping at step {self.step}: {self.stop_reason}")
        if self._fetch_scope is not None:
            self._fetch_scope.cancel()
        for request in list(self.pending):
            self._complete_pending(request.kind, error="the daemon is stopping")
        bridge_ok = self.bridge is not None and self.bridge.available
        if bridge_ok and self.exit_code == 0:
            await self._evaluate("end")
        if self.cfg.checkpoint.at_shutdown and self._started and self.trainer is not None and self.step > 0:
            with anyio.CancelScope(shield=True):
                await self._checkpoint()
        await self._emergency_stop()
        self._print_summary()

    async def _emergency_stop(self) -> None:
        if self.bridge is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await self.bridge.stop()
                except Exception as exc:  # noqa: BLE001 — reported; the exit code says it
                    log.error("inference_stop_failed", error=str(exc))
                    self.exit_code = self.exit_code or 1

    def _print_summary(self) -> None:
        if not self.cfg.run.progress:
            return
        evals = [r for r in self.metrics.read() if r["kind"] == "eval"]
        lines = [
            f"grpod: {self.stop_reason or 'stopped'} at step {self.step}/{self.cfg.train.steps} "
            f"({self.trained_steps} trained, {self.skipped_batches} skipped), "
            f"policy version {self.bridge.policy_version if self.bridge else '-'}, run dir {self.run_dir}"
        ]
        if len(evals) >= 2:
            lines.append(
                f"held-out accuracy: {evals[0]['eval_accuracy']:.3f} (step {evals[0]['step']}) -> "
                f"{evals[-1]['eval_accuracy']:.3f} (step {evals[-1]['step']}) on {evals[-1]['eval_size']} problems"
            )
        if self.last_checkpoint:
            lines.append(f"last checkpoint: {self.last_checkpoint['path']}")
        print("\n".join(lines), file=sys.stderr, flush=True)


def _unwrap(exc: BaseException) -> BaseException | None:
    """The first real error inside (possibly nested) exception groups; None for cancellation."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _unwrap(inner)
            if found is not None:
                return found
        return None
    if isinstance(exc, (KeyboardInterrupt, SystemExit, anyio.get_cancelled_exc_class())):
        return None
    return exc


def run_daemon(cfg: GrpodConfig, config_path: Path | None = None) -> int:
    daemon = Daemon(cfg, config_path=config_path)
    try:
        return anyio.run(daemon.run)
    except ConfigError:
        raise
