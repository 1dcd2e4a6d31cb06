"""`StepSyncs`: when the step loop's syncs run, and how each is carried out.

The `SyncSchedule` decides (a step's sync when due, one owed while an evaluation runs beside
training, one before an evaluation, an operator's `ctl sync`); this carries the decision out
on the bridge and answers the operator's requests with it:
- a step's own sync may be pipelined: the trainer half now, the engines' half in the loop's
  task group while the next step trains;
- an operator's sync waits for a running evaluation to end (the engines keep its version to its
  end), unless a stop comes first: then nothing is synced and the request is answered so;
- a sync whose weights could not be written (`SyncNotSaved`) raises the sync alarm and training
  goes on; `BridgeFailed` is raised to the loop (the run stops).
Like the loop, it runs in the loop's task (the bridge's trainer half touches the trainer).
"""

from __future__ import annotations

from typing import Any

from anyio.abc import TaskGroup

from grpod.bridges.base import BridgeFailed, StagedSync, SyncNotSaved, SyncRecord
from grpod.config import GrpodConfig
from grpod.daemon.desk import STOPPING, OperatorDesk
from grpod.daemon.evaluation import Evaluations
from grpod.daemon.progress import RunProgress
from grpod.daemon.sync_schedule import Sync, SyncSchedule
from grpod.service.notify import Heartbeat
from grpod.service.race import first_of


class StepSyncs:
    def __init__(self, cfg: GrpodConfig, *, bridge, evaluations: Evaluations, desk: OperatorDesk,
                 progress: RunProgress, heartbeat: Heartbeat, reporter: Any) -> None:
        self.cfg = cfg
        self.bridge = bridge
        self.evaluations = evaluations
        self.desk = desk
        self.progress = progress
        self.heartbeat = heartbeat
        self.reporter = reporter
        # When the engines get the trainer's weights: due, owed, held by an evaluation, forced.
        self.schedule = SyncSchedule(cadence=bridge.sync_due)
        self.work: TaskGroup | None = None  # the loop's: where a pipelined sync's engines' half runs

    @property
    def served_step(self) -> int:
        """The step whose weights the engines serve: this step, less those trained since the
        last sync."""
        return self.progress.step - self.schedule.unsynced

    async def after_step(self, *, skipped: bool, fenced: list[SyncRecord]) -> bool:
        """The step's sync, as the schedule decides (an operator's request taken meanwhile is
        served here rather than again at the boundary). True when the step spent time on a sync."""
        requests = self.desk.take_requests("sync")
        if requests and not await self._evaluation_ended_before_stop(requests):
            requests = []
        decision = self.schedule.after_step(
            self.progress.step, trained=not skipped, fenced=bool(fenced), requested=bool(requests),
            held=self.evaluations.holds_syncs,
        )  # fmt: skip
        return await self.carry_out(decision, requests) or bool(fenced)

    async def requested(self, request) -> None:
        """An operator's `ctl sync` taken at the boundary."""
        if await self._evaluation_ended_before_stop([request]):
            await self.carry_out(self.schedule.requested(), [request])

    async def carry_out(self, decision: Sync, requests: list) -> bool:
        """Run the sync the schedule decided, if it ships one, and answer `requests` with it.
        True when a sync ran or was staged."""
        if not decision.ships:
            return False
        step = self.progress.step
        try:
            if decision is Sync.STEP and self.cfg.source.overlap and self.bridge.pipelined:
                # The trainer half now; the engines apply and probe while the next step trains.
                staged = await self.bridge.stage_sync()
                assert self.work is not None
                self.work.start_soon(self._finish, staged, step)
                return True
            record = await self.bridge.sync_now(forced=decision is Sync.FORCED)
        except SyncNotSaved as exc:  # no engine touched: the alarm is up, training goes on, the next sync retries
            self.reporter.sync_alarm.failed(step, str(exc))
            for request in requests:
                request.complete(error=str(exc))
            return False
        except BridgeFailed as exc:
            for request in requests:
                request.complete(error=str(exc))
            raise
        self.reporter.sync_done(record, step)
        for request in requests:
            request.complete(record.as_dict())
        return True

    async def _evaluation_ended_before_stop(self, requests: list) -> bool:
        """An operator's sync waits for a running evaluation to end, unless a stop comes first:
        then `requests` are answered that the daemon is stopping, and False returned."""
        if self.evaluations.describe() is None:
            return True
        winner, _ = await first_of(self.evaluations.idle, self.desk.stopping.wait)
        if winner == 0:
            return True
        for request in requests:
            request.complete(error=STOPPING)
        return False

    async def end_evaluation(self) -> None:
        """The running evaluation ends, then the engines get the trainer's weights: before the
        next evaluation, and at the run's end, the final evaluation measures the trainer's last
        step, not the last one the cadence synced. Without evaluations, only the sync an
        evaluation held back runs."""
        await self.evaluations.idle()
        due = self.schedule.evaluation_due() if self.cfg.eval.size > 0 else self.schedule.evaluation_ended()
        await self.carry_out(due, [])

    async def _finish(self, staged: StagedSync, step: int) -> None:
        with self.heartbeat.running():
            record = await self.bridge.finish_sync(staged)
        self.reporter.sync_done(record, step)
