"""`StepLoop`: the training loop — one step after another until the run ends.

    evaluate the starting policy (beside training, or in line: `Evaluations`)
    while steps remain:
        at the boundary: live settings, `ctl sync` / `ctl checkpoint`, wait while paused
        batch     = the next train.groups_per_step groups from the rollout buffer (a CPU
                    engine holds the trainer's cores while the loop waits, and the trainer
                    the engine's while generation is parked and the engine idle: `CoreLoan`)
        admitted  = validate → deduplicate → staleness (BatchAdmission)
        train     = plan, then per part: prepare (forward/backward/clip), fence(apply)
        sync      = what the `SyncSchedule` decides: the bridge's sync when due (every
                    bridge.sync_every steps, when a step trained since the last one), whole or
                    its trainer half with the engines' half in the background (pipelined);
                    owed while an evaluation runs beside training, to the first step after it
                    or the next evaluation; an operator's `ctl sync`
        record    = metrics.jsonl, the progress line, alarms
        periodic  = checkpoint / evaluation every N steps

The loop is the one task that touches the trainer: every trainer call is a worker-thread call
awaited here (the event loop keeps answering the control socket meanwhile), and the bridge's
trainer half runs here too. With `source.overlap`, the fetch task fills the buffer beside it.

Everything the loop reads or advances is handed in: the desk (operator requests), the progress
(counters), the admission gates, the bridge (sync protocol) and its `Policy`, the store
(checkpoints), the reporter (records). It runs in milliseconds with fakes of each.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup

from grpod.bridges.base import SyncRecord
from grpod.config import GrpodConfig
from grpod.daemon.desk import OperatorDesk
from grpod.daemon.evaluation import Evaluations
from grpod.daemon.live import SettingChange
from grpod.service.notify import Heartbeat
from grpod.daemon.progress import RunProgress
from grpod.daemon.step_syncs import StepSyncs
from grpod.inference.cores import CoreLoan
from grpod.rollouts.admission import BatchAdmission
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.replay import record_groups
from grpod.rollouts.rewards import step_reward_metrics
from grpod.run.store import BrokenTrainerState, RunSnapshot
from grpod.service.race import first_of

log = structlog.get_logger(__name__)


async def train_batch(trainer, bridge, groups: list[RolloutGroup]) -> tuple[dict[str, Any], list[SyncRecord]]:
    """The trainer's phases for one batch, each call in a worker thread: plan, then per part
    prepare (forward/backward/clip) and the optimizer update through the bridge's fence. Returns
    the metrics and the syncs the fence made (bridge mode `shared`: each update is a sync)."""
    in_thread = anyio.to_thread.run_sync
    plan = await in_thread(trainer.plan, groups)
    fenced: list[SyncRecord] = []
    for part in trainer.parts(plan):
        prepared = await in_thread(trainer.prepare, plan, part)
        if not prepared.finite:
            continue

        async def apply(prepared=prepared) -> None:
            await in_thread(trainer.apply, prepared)

        record = await bridge.fence(apply)
        if record is not None:
            fenced.append(record)
    return await in_thread(trainer.finish, plan), fenced


class StepLoop:
    def __init__(
        self,
        cfg: GrpodConfig,
        *,
        trainer,
        bridge,
        source,
        buffer: RolloutBuffer,
        admission: BatchAdmission,
        desk: OperatorDesk,
        progress: RunProgress,
        heartbeat: Heartbeat,
        reporter,
        store,
        run_dir: Path,
        cores: CoreLoan | None = None,
    ) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.bridge = bridge
        self.source = source
        self.buffer = buffer
        self.admission = admission
        self.desk = desk
        self.progress = progress
        self.heartbeat = heartbeat
        self.reporter = reporter
        self.store = store
        self.run_dir = run_dir
        self.cores = cores or CoreLoan.off("not planned")
        self.source_exhausted = False
        self._work: TaskGroup | None = None
        self.evaluations = Evaluations(
            cfg.eval, source=source, reporter=reporter, progress=progress,
            beside_training=cfg.eval.overlap and bridge.pipelined,
        )
        self.syncs = StepSyncs(cfg, bridge=bridge, evaluations=self.evaluations, desk=desk, progress=progress,
                               heartbeat=heartbeat, reporter=reporter)

    # ---- the loop -------------------------------------------------------------------------
    async def run(self) -> None:
        """Train until `train.steps`, a stop, a drain or an exhausted source; raises
        BridgeFailed when the engines cannot be kept in step."""
        train = self.cfg.train
        self.progress.begin_training()
        self.bridge.policy.trainer_step = self.progress.step  # a resumed run's steps
        if self.cores.idle:
            self.trainer.threads_now = self.trainer_threads
        async with anyio.create_task_group() as work:
            self._work = self.syncs.work = work
            if self.cfg.source.overlap:
                work.start_soon(self.fetch)
            await self.evaluations.run("start", work, step=self.served_step)
            while self.progress.step < train.steps:
                if not await self.at_boundary():
                    break
                waited = time.perf_counter()
                groups = await self.next_batch(train.groups_per_step)
                if groups is None:
                    break
                await self.step(groups, waited_s=time.perf_counter() - waited)
                await self.periodic()
            if not self.desk.stop_requested:
                # A stop abandons a running evaluation (cancelled below); any other end keeps it.
                await self.syncs.end_evaluation()
            await self.bridge.settled()
            work.cancel_scope.cancel()
        self._work = self.syncs.work = None
        self._conclude()

    async def at_boundary(self) -> bool:
        """Serve the desk (live settings, sync and checkpoint requests); wait while paused.
        False when the run should stop."""
        while not self.desk.stop_requested:
            self.desk.apply_changes(self.progress.step, self._apply_setting)
            for request in self.desk.take_requests("sync"):
                await self.syncs.requested(request)
            for request in self.desk.take_requests("checkpoint"):
                try:
                    info, error = await self.reporter.checkpoint_alarm.guard(self.progress.step, self.checkpoint)
                except BrokenTrainerState as exc:
                    request.complete(error=f"checkpoint failed: {exc}")
                    raise  # the run stops: training on would only break more
                request.complete(info) if error is None else request.complete(error=f"checkpoint failed: {error}")
            self.desk.settle()
            if not self.desk.paused:
                return True
            await self.desk.first_or_attention(self.desk.wait_resumed)
        return False

    def trainer_threads(self) -> int:
        """The trainer's threads for its next micro-batch (asked from its worker thread): the idle
        engines' too while generation is parked, the prefetch queue full or no overlap, and no
        evaluation runs beside training (`CoreLoan`)."""
        parked = not self.cfg.source.overlap or len(self.buffer) >= self.buffer.capacity
        return self.cores.trainer_threads(parked and self.evaluations.describe() is None)

    async def next_batch(self, n: int) -> list[RolloutGroup] | None:
        """The next step's `n` groups, or None when the run should end (stop, drained, exhausted).
        While it waits for them the engine holds the trainer's cores (`CoreLoan`)."""
        if len(self.buffer) >= n and not self.desk.stop_requested and not self.desk.draining:
            return await self.buffer.take_available(n)  # no wait: nothing to lend
        async with self.cores.while_waiting():
            return await self._wait_for_batch(n)

    async def _wait_for_batch(self, n: int) -> list[RolloutGroup] | None:
        while not self.desk.stop_requested:
            if self.desk.draining or (self.source_exhausted and len(self.buffer) < n):
                return await self.buffer.take_available(n) or None
            if not self.cfg.source.overlap and len(self.buffer) < n:
                if await self._fill(n - len(self.buffer)):
                    self.source_exhausted = self.source.stats.exhausted
                elif not await self.at_boundary():
                    return None
                continue

            async def ready() -> bool:
                await self.buffer.wait_ready(n)
                return True

            if await self.desk.first_or_attention(ready):
                return await self.buffer.take_available(n)
            if not await self.at_boundary():
                return None
        return None

    async def _fill(self, count: int) -> bool:
        """The source's `fill` (no overlap), raced against the operator: True once it returned.
        A fill safe to cancel (Atropos's waits for a batch as long as it takes) gives way to
        anything that needs the loop (a request, a change, pause, drain, stop); one that is not
        (a sampling source's drew its prompts) gives way to a stop only, as the fetch task does,
        and finishes (a generation) before the boundary serves a request."""

        async def fill() -> bool:
            await self.source.fill(self.buffer, count)
            return True

        if self.source.fill_cancel_safe:
            return bool(await self.desk.first_or_attention(fill))
        winner, _ = await first_of(fill, self.desk.stopping.wait)
        return winner == 0

    async def step(self, groups: list[RolloutGroup], waited_s: float = 0.0) -> None:
        started = time.perf_counter()
        admitted = self.admission.admit(groups, self.bridge.policy.version)
        if self.cfg.run.record_rollouts and admitted.groups:
            # Only what reaches the trainer (a replay then trains exactly these).
            record_groups(self.run_dir / "rollouts.jsonl", self.progress.step + 1, admitted.groups)
        self.heartbeat.busy()
        metrics, fenced = await self.train(admitted.groups)
        metrics["completion_tokens"] = float(sum(sum(mask) for g in admitted.groups for mask in g.loss_mask))
        self.progress.count_batch(trained=not metrics.get("skipped"), metrics=metrics)
        self.bridge.policy.trainer_step = self.progress.step  # TRL's global_step, for reward functions
        self.heartbeat.progress()
        train_s = time.perf_counter() - started
        sync_began = time.perf_counter()
        self.heartbeat.busy()
        synced = await self.syncs.after_step(skipped=bool(metrics.get("skipped")), fenced=fenced)
        self.heartbeat.progress()
        # Seconds this step spent on a sync: all of it, or its trainer half when pipelined.
        sync_s = time.perf_counter() - sync_began if synced else None
        record = {
            **metrics,
            "groups": len(groups),
            "rejected": admitted.rejected,
            "staleness_mean": admitted.staleness_mean,
            "staleness_max": admitted.staleness_max,
            "policy_version": self.bridge.policy.version,
            "train_s": round(train_s, 4),
            # Seconds the loop waited for this batch (the engines generating, or a pause).
            "batch_wait_s": round(waited_s, 4),
            "step_s": round(time.perf_counter() - started, 4),
            "queue_depth": len(self.buffer),
            "group_ids": [g.group_id for g in admitted.groups],
            "sync_s": round(sync_s, 4) if sync_s is not None else None,
            # The engines lag this step's weights by a sync an evaluation holds back.
            "sync_deferred": self.syncs.schedule.owed,
            # The dataset source's reward functions, each one's mean over the step's groups.
            **step_reward_metrics(groups),
            **self.source.stats.step_metrics(),
        }
        share = self.progress.gradient_token_share(record.get("sampled_tokens"))
        if share is not None:
            record["gradient_token_share"] = share
        self.reporter.step_done(record)

    async def train(self, groups: list[RolloutGroup]) -> tuple[dict[str, Any], list[SyncRecord]]:
        if not groups:
            # Still the trainer's: a skipped batch advances the lr schedule as every other does
            # (train.schedule counts batches), and trainer ranks stay in step.
            log.warning("step_skipped", reason="no valid group in the batch")
        metrics, fenced = await train_batch(self.trainer, self.bridge, groups)
        for record in fenced:
            self.reporter.sync_done(record, self.progress.step + 1)
        return metrics, fenced

    @property
    def served_step(self) -> int:
        """The step whose weights the engines serve (`StepSyncs.served_step`)."""
        return self.syncs.served_step

    async def periodic(self) -> None:
        step = self.progress.step
        if self.cfg.checkpoint.every and step % self.cfg.checkpoint.every == 0:
            await self.reporter.checkpoint_alarm.guard(step, self.checkpoint)  # failed: trains on, the next retries
        if self.cfg.eval.every and step % self.cfg.eval.every == 0 and step < self.cfg.train.steps:
            # The evaluation measures this step's weights: the previous one ends first, and the
            # steps since the last sync ship now, a sync it held back too (without this,
            # evaluations back to back held every sync: 8 syncs in 83 steps on SmolLM2 with 16
            # groups in flight).
            await self.syncs.end_evaluation()
            await self.bridge.settled()  # the engines serve the step's sync (when one was due)
            await self.evaluations.run("periodic", self._work, step=self.served_step)

    # ---- what else the loop's task does with the trainer ------------------------------------
    async def checkpoint(self) -> dict[str, Any]:
        """A checkpoint of the run as it is at this boundary (after any sync in flight)."""
        await self.bridge.settled()  # the checkpoint's policy version is the trainer's weights'
        self.heartbeat.busy()
        began = time.perf_counter()
        state = self.checkpoint_state()  # what the snapshot holds: groups accepted up to now...
        snapshot = RunSnapshot(
            step=self.progress.step,
            policy_version=self.bridge.policy.version,
            buffered=self.buffer.snapshot(),
            source_cursor=self.source.cursor(),
            extra={
                "rejections": self.admission.rejections.as_dict(),
                "config_changes": self.desk.config_changes,
                "operator_values": dict(self.desk.operator_values),
                "step_counts": {"trained": self.progress.trained_steps, "skipped": self.progress.skipped_batches},
            },
        )
        path = await anyio.to_thread.run_sync(self.store.save, self.trainer, snapshot)
        self.heartbeat.progress()
        self.reporter.checkpoint_alarm.written(snapshot.step)
        info = {"path": str(path), "step": snapshot.step, "seconds": round(time.perf_counter() - began, 3)}
        self.progress.last_checkpoint = {"path": str(path), "step": snapshot.step, "time": time.time(), "state": state}
        return info

    def checkpoint_state(self) -> list:
        """What a checkpoint holds that changes between checkpoints: the step, the groups accepted,
        the policy version (a `ctl sync` moves it) and the operator's `ctl set` values."""
        return [self.progress.step, self.buffer.accepted, self.bridge.policy.version, sorted(self.desk.operator_values.items())]

    async def fetch(self) -> None:
        """Keep the buffer filled (overlap mode) until cancelled, drained or the source ends."""

        async def produce() -> None:
            if self.desk.draining:
                return
            await self.source.run(self.buffer, self.desk.wait_resumed)
            # Only a finite source (replay) returns: the run ends once the buffer is used up.
            self.source_exhausted = True
            self.desk.wake()

        await first_of(produce, self.desk.drained.wait)

    def _apply_setting(self, change: SettingChange) -> None:
        if change.key == "train.lr":
            self.trainer.set_learning_rate(change.new)

    def _conclude(self) -> None:
        self.progress.conclude(
            steps=self.cfg.train.steps, stopped=self.desk.stop_requested, draining=self.desk.draining,
            exhausted=self.source_exhausted,
        )
