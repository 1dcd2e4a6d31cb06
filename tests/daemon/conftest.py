"""The step loop's collaborators as small stand-ins, wired the way `grpod.daemon.components` wires
the real ones: what is under test is the loop's order of operations and its bookkeeping."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from grpod.bridges.base import SyncRecord
from grpod.config import GrpodConfig, load_config
from grpod.daemon.alarms import LogprobGapAlarm, SourceErrorAlarm
from grpod.daemon.desk import OperatorDesk
from grpod.service.logs import MetricsLog
from grpod.service.notify import Heartbeat, SystemdNotifier
from grpod.daemon.progress import RunProgress
from grpod.daemon.reporting import Reporter
from grpod.daemon.step_loop import StepLoop
from grpod.rollouts.admission import BatchAdmission
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.source import SourceStats
from grpod.rollouts.validation import RejectionCounter


class StandInBridge:
    """A policy version and syncs that only count (no engine): `sync_every` from the config."""

    state = "SERVING"
    pipelined = False
    available = True

    def __init__(self, version: int = 0, sync_every: int = 1) -> None:
        self.policy = SimpleNamespace(version=version, endpoint=lambda: None)
        self.sync_every = sync_every
        self.syncs: list[tuple[int, bool]] = []  # (version, forced)
        self.fenced_updates = 0

    def sync_due(self, step: int) -> bool:
        return step % self.sync_every == 0

    async def fence(self, update):
        self.fenced_updates += 1
        await update()
        return None

    async def sync_now(self, *, forced: bool = False) -> SyncRecord:
        self.policy.version += 1
        self.syncs.append((self.policy.version, forced))
        return SyncRecord(self.policy.version, {}, 0.0, {"skipped": True}, forced)

    async def settled(self) -> None:
        return None

    def describe(self) -> dict:
        return {"mode": "stand-in", "state": self.state, "policy_version": self.policy.version, "restarts": 0, "syncs": len(self.syncs)}


class ListSource:
    """Groups handed over on request (`fill`), or all at once by `run` (then exhausted)."""

    kind = "list"
    fill_cancel_safe = False  # `fill` pops a group before the buffer holds it

    def __init__(self, groups=()) -> None:
        self.groups = list(groups)
        self.stats = SourceStats()
        self.evaluations: list[int] = []

    def cursor(self) -> dict:
        return {"kind": self.kind, "left": len(self.groups)}

    async def fill(self, buffer, count: int) -> None:
        for _ in range(min(count, len(self.groups))):
            await buffer.put(self.groups.pop(0))
        self.stats.exhausted = not self.groups

    async def run(self, buffer, may_generate) -> None:
        while self.groups:
            await may_generate()
            await buffer.put(self.groups.pop(0))
        self.stats.exhausted = True

    async def evaluate(self, size: int, max_tokens: int):
        self.evaluations.append(size)
        return {"eval_accuracy": 0.5, "eval_size": size}


class IdleSource(ListSource):
    """A source that never delivers and never ends (the test feeds the buffer itself)."""

    async def run(self, buffer, may_generate) -> None:
        await anyio.sleep_forever()


class MemoryStore:
    """Checkpoints kept as snapshots in a list."""

    def __init__(self) -> None:
        self.saved = []

    def save(self, trainer, snapshot):
        self.saved.append(snapshot)
        return f"checkpoint-{snapshot.step}"


def make_loop(cfg: GrpodConfig, trainer, *, bridge=None, source=None, vocab_size: int = 64) -> StepLoop:
    run_dir = cfg.run.dir
    progress = RunProgress(cfg.train.steps)
    buffer = RolloutBuffer(max(cfg.source.prefetch_groups, cfg.train.groups_per_step))
    rejections = RejectionCounter()
    heartbeat = Heartbeat(cfg.notify.stall_after_s)
    reporter = Reporter(
        cfg, progress=progress, buffer=buffer, rejections=rejections, heartbeat=heartbeat,
        notifier=SystemdNotifier(address=""), metrics=MetricsLog(run_dir / "metrics.jsonl"),
        logprob_gap=LogprobGapAlarm(cfg.train.logprob_gap_alarm),
        source_alarm=SourceErrorAlarm(cfg.source.error_alarm_s, cfg.source.fail_after_s), run_dir=run_dir,
    )
    desk = OperatorDesk(cfg, progress, status=reporter.status)
    admission = BatchAdmission(cfg.train, vocab_size=vocab_size, max_seq_len=cfg.model.max_seq_len, rejections=rejections)
    bridge = bridge or StandInBridge()
    source = source or ListSource()
    reporter.attach(desk=desk, bridge=bridge, source=source, admission=admission)
    loop = StepLoop(
        cfg, trainer=trainer, bridge=bridge, source=source, buffer=buffer, admission=admission, desk=desk,
        progress=progress, heartbeat=heartbeat, reporter=reporter, store=MemoryStore(), run_dir=run_dir,
    )
    reporter.attach(evaluations=loop.evaluations)
    return loop


@pytest.fixture()
def loop_config(tmp_path):
    def build(*overrides: str) -> GrpodConfig:
        return load_config(None, [f"run.dir={str(tmp_path / 'run')!r}", "run.progress=false", *overrides])

    return build


def run_async(fn, *args):
    return anyio.run(fn, *args)
