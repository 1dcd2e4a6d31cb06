"""The step loop with stand-ins for every collaborator: its order of operations, its boundaries
(pause, drain, `ctl sync`, `ctl checkpoint`, live settings, stop) and how a run ends. Milliseconds,
no vLLM, no model; waits are on events (`anyio.wait_all_tasks_blocked`), never on the clock."""

from __future__ import annotations

import anyio
import pytest

from grpod.bridges.base import StagedSync, SyncRecord
from grpod.daemon.control import ControlError
from grpod.rollouts.group import RolloutGroup
from tests.daemon.conftest import IdleSource, ListSource, StandInBridge, make_loop

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class FakeTrainer:
    """The trainer's phases with no model: each part 'trains' by counting; lr is remembered."""

    vocab_size = 64
    threads_now = None  # the step loop's question, set by it where the engines' cores may be lent

    def __init__(self, parts_per_batch: int = 1) -> None:
        self.parts_per_batch = parts_per_batch
        self.batches: list[list[str]] = []
        self.applied = 0
        self.lr = 1e-4
        self.events: list[str] = []

    def plan(self, groups):
        if groups:  # an empty batch (admission rejected every group) is planned, as a skip
            self.batches.append([g.group_id for g in groups])
        self.events.append("plan")
        return {"groups": groups}

    def parts(self, plan):
        return [[i] for i in range(self.parts_per_batch)] if plan["groups"] else []

    def prepare(self, plan, part):
        self.events.append("prepare")
        return type("Prepared", (), {"finite": True})()

    def apply(self, prepared):
        self.events.append("apply")
        self.applied += 1

    def finish(self, plan):
        self.events.append("finish")
        self.finished = getattr(self, "finished", 0) + 1  # every batch: the lr schedule's count
        if not plan["groups"]:
            return {"skipped": 1.0}
        return {"loss": 0.5, "reward_mean": 0.25, "skipped": 0.0, "tokens": 10.0}

    def set_learning_rate(self, lr):
        self.lr = lr


def groups(n: int, start: int = 0) -> list[RolloutGroup]:
    out = []
    for i in range(start, start + n):
        tokens = [[1, 5 + i % 40, 7, 2], [1, 5 + i % 40, 9, 2]]
        out.append(RolloutGroup(tokens, [[0, 0, 1, 1]] * 2, [0.0, 1.0], [[0.0, 0.0, -1.0, -1.0]] * 2, group_id=f"g{i}"))
    return out


def loop_with(loop_config, *overrides, trainer=None, bridge=None, source=None):
    """A loop of 2 groups per step; without a `source`, the test feeds the buffer itself."""
    cfg = loop_config("train.groups_per_step=2", "source.overlap=false", *overrides)
    return make_loop(cfg, trainer or FakeTrainer(), bridge=bridge, source=source or IdleSource())


async def test_each_step_trains_then_syncs_when_due_and_the_run_ends_steps_done(loop_config):
    bridge = StandInBridge(sync_every=2)
    loop = loop_with(loop_config, "train.steps=4", bridge=bridge, source=ListSource(groups(8)))
    await loop.run()
    assert loop.trainer.batches == [["g0", "g1"], ["g2", "g3"], ["g4", "g5"], ["g6", "g7"]]
    assert loop.trainer.events[:4] == ["plan", "prepare", "apply", "finish"]
    assert bridge.syncs == [(1, False), (2, False)], "a sync after steps 2 and 4"
    assert bridge.fenced_updates == 4, "every optimizer update goes through the bridge's fence"
    assert loop.progress.step == loop.progress.trained_steps == 4 and loop.progress.stop_reason == "steps done"
    records = loop.reporter.metrics.read()
    # A step's sync is written before the step's own record (both at the step's number).
    assert [(r["kind"], r["step"]) for r in records] == [
        ("step", 1), ("sync", 2), ("step", 2), ("step", 3), ("sync", 4), ("step", 4)
    ]
    assert [r["policy_version"] for r in records if r["kind"] == "step"] == [0, 1, 1, 2]


async def test_a_pause_holds_the_loop_at_the_boundary_until_resume(loop_config):
    loop = loop_with(loop_config, "train.steps=2", "source.overlap=true")
    await loop.desk.ctl_pause({})
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        for group in groups(4):
            await loop.buffer.put(group)
        await anyio.wait_all_tasks_blocked()
        assert loop.progress.step == 0 and loop.trainer.batches == [], "paused: no step with data waiting"
        await loop.desk.ctl_resume({})
    assert loop.progress.step == 2


async def test_a_ctl_sync_is_served_at_once_while_the_loop_waits_for_data(loop_config):
    bridge = StandInBridge(sync_every=100)
    loop = loop_with(loop_config, "train.steps=1", "source.overlap=true", bridge=bridge)
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        await anyio.wait_all_tasks_blocked()
        reply = await loop.desk.ctl_sync({})
        assert reply["version"] == 1 and reply["forced"] and loop.progress.step == 0
        for group in groups(2):
            await loop.buffer.put(group)
    assert bridge.syncs == [(1, True)] and loop.progress.step == 1


async def test_a_ctl_sync_during_a_step_is_the_steps_sync_not_a_second_one(loop_config):
    bridge = StandInBridge(sync_every=1)
    trainer = FakeTrainer()
    loop = loop_with(loop_config, "train.steps=1", bridge=bridge, trainer=trainer, source=ListSource(groups(2)))
    replies = []
    real_finish = trainer.finish

    def finish_and_ask(plan):  # the operator asks while the step trains (in the trainer's thread)
        anyio.from_thread.run_sync(tg.start_soon, ask)
        return real_finish(plan)

    async def ask():
        replies.append(await loop.desk.ctl_sync({}))

    trainer.finish = finish_and_ask
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
    assert bridge.syncs == [(1, True)] and replies[0]["version"] == 1


async def test_a_ctl_checkpoint_records_the_step_the_buffer_and_the_cursor(loop_config):
    loop = loop_with(loop_config, "train.steps=1", "source.overlap=true")
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        await loop.buffer.put(groups(1)[0])
        await anyio.wait_all_tasks_blocked()
        info = await loop.desk.ctl_checkpoint({})
        await loop.buffer.put(groups(1, start=1)[0])
    (snapshot,) = loop.store.saved
    assert info["path"] == "checkpoint-0" and snapshot.step == 0
    assert [g.group_id for g in snapshot.buffered] == ["g0"], "the accepted, untrained group is kept"
    assert snapshot.source_cursor == {"kind": "list", "left": 0}


async def test_drain_trains_what_is_buffered_then_ends(loop_config):
    loop = loop_with(loop_config, "train.steps=10", "source.overlap=true")
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        for group in groups(3):
            await loop.buffer.put(group)
        await anyio.wait_all_tasks_blocked()
        await loop.desk.ctl_drain({})
    assert loop.trainer.batches == [["g0", "g1"], ["g2"]], "the last batch is what was left"
    assert loop.progress.stop_reason == "drained" and len(loop.buffer) == 0


async def test_a_stop_while_waiting_for_data_ends_the_loop_with_its_reason(loop_config):
    loop = loop_with(loop_config, "train.steps=10", "source.overlap=true")
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        await anyio.wait_all_tasks_blocked()
        await loop.desk.ctl_stop({})
    assert loop.progress.step == 0 and loop.progress.stop_reason == "ctl stop" and loop.progress.exit_code == 0


async def test_a_live_setting_is_applied_before_the_next_step(loop_config):
    trainer = FakeTrainer()
    loop = loop_with(loop_config, "train.steps=1", "source.overlap=true", trainer=trainer)
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        await anyio.wait_all_tasks_blocked()
        await loop.desk.ctl_set({"key": "train.lr", "value": 5e-4})
        await anyio.wait_all_tasks_blocked()
        assert trainer.lr == 5e-4 and loop.cfg.train.lr == 5e-4, "applied at the idle loop's boundary"
        for group in groups(2):
            await loop.buffer.put(group)
    assert loop.desk.config_changes[0]["key"] == "train.lr" and loop.desk.config_changes[0]["step"] == 0


async def test_an_exhausted_source_ends_the_run_once_the_buffer_is_used(loop_config):
    loop = loop_with(loop_config, "train.steps=10", "source.overlap=true", source=ListSource(groups(5)))
    await loop.run()
    assert loop.trainer.batches == [["g0", "g1"], ["g2", "g3"], ["g4"]]
    assert loop.progress.stop_reason == "source exhausted"


async def test_a_sync_due_at_a_skipped_batch_carries_the_steps_trained_before_it(loop_config):
    """sync_every = 2: step 1 trains, steps 2-4 are skipped (every group invalid). The sync due at
    step 2 still ships step 1's weights; at step 4 nothing trained since, so nothing is synced."""
    batches = groups(8)
    for group in batches[2:]:
        group.scores = [float("nan")] * 2
    bridge = StandInBridge(sync_every=2)
    loop = loop_with(loop_config, "train.steps=4", bridge=bridge, source=ListSource(batches))
    await loop.run()
    steps = [r for r in loop.reporter.metrics.read() if r["kind"] == "step"]
    assert [bool(s.get("skipped")) for s in steps] == [False, True, True, True]
    assert loop.trainer.finished == 4, "every batch, skipped or not, is the trainer's (its lr schedule counts it)"
    assert bridge.syncs == [(1, False)], "step 2 ships step 1's update; step 4 has nothing new to ship"
    assert steps[1]["sync_s"] is not None and steps[3]["sync_s"] is None
    assert [s["policy_version"] for s in steps] == [0, 1, 1, 1]


async def test_a_run_that_trained_nothing_fails(loop_config):
    bad = groups(2)
    for group in bad:
        group.scores = [float("nan")] * 2
    loop = loop_with(loop_config, "train.steps=1", source=ListSource(bad))
    await loop.run()
    assert loop.progress.exit_code == 1 and loop.progress.stop_reason.startswith("no step trained")
    assert loop.trainer.batches == [], "nothing valid reached the trainer"


class PipelinedBridge(StandInBridge):
    """A copy-shipping mode: the trainer half returns, the engine half waits for `release`."""

    pipelined = True

    def __init__(self) -> None:
        super().__init__(sync_every=1)
        self.release = anyio.Event()
        self.slot = anyio.Semaphore(1)  # one sync in flight, as the real bridge

    async def stage_sync(self, forced: bool = False) -> StagedSync:
        await self.slot.acquire()
        return StagedSync(self.policy.version + 1, None, [[0.0]], {"save": 0.0}, 0.0, forced)

    async def finish_sync(self, staged: StagedSync) -> SyncRecord:
        try:
            await self.release.wait()
            self.policy.version = staged.version
            self.syncs.append((staged.version, staged.forced))
            return SyncRecord(staged.version, {}, 0.0, {"skipped": True})
        finally:
            self.slot.release()

    async def settled(self) -> None:
        async with self.slot:
            pass


async def test_a_pipelined_sync_finishes_while_the_next_step_trains(loop_config):
    bridge = PipelinedBridge()
    loop = loop_with(loop_config, "train.steps=2", "source.overlap=true", bridge=bridge)
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        for group in groups(4):
            await loop.buffer.put(group)
        await anyio.wait_all_tasks_blocked()
        # Step 2 trained while sync 1's engine half was in flight; its own sync waits for that one.
        assert loop.progress.step == 2 and bridge.syncs == []
        bridge.release.set()
    assert bridge.syncs == [(1, False), (2, False)]
    assert [r["kind"] for r in loop.reporter.metrics.read()].count("sync") == 2


class FencingBridge(StandInBridge):
    """`shared`: each optimizer update is a sync made inside the fence; no sync after the step."""

    def __init__(self) -> None:
        super().__init__(sync_every=1)
        self.order: list[str] = []

    def sync_due(self, step: int) -> bool:
        return False

    async def fence(self, update):
        self.order.append("pause")
        await update()
        self.order.append("resume")
        self.policy.version += 1
        return SyncRecord(self.policy.version, {"optimizer_step": 0.0}, 0.0, {"ok": True})


async def test_the_fence_is_a_line_of_the_loop_and_its_syncs_are_recorded(loop_config):
    bridge, trainer = FencingBridge(), FakeTrainer(parts_per_batch=2)
    loop = loop_with(loop_config, "train.steps=1", bridge=bridge, trainer=trainer, source=ListSource(groups(2)))
    await loop.run()
    assert trainer.events == ["plan", "prepare", "apply", "prepare", "apply", "finish"]
    assert bridge.order == ["pause", "resume", "pause", "resume"] and bridge.policy.version == 2
    records = loop.reporter.metrics.read()
    assert [r["kind"] for r in records] == ["sync", "sync", "step"]
    assert records[-1]["sync_s"] is not None


class GatedEvalSource(IdleSource):
    """A source whose evaluations run until the test opens `gate` (the test feeds the buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = anyio.Event()

    async def evaluate(self, size: int, max_tokens: int):
        self.evaluations.append(size)
        await self.gate.wait()
        return {"eval_accuracy": 0.5, "eval_size": size, "policy_version": self.policy.version}


async def settled_at(loop, step: int) -> None:
    """Wait until the loop has finished `step` and everything is blocked again (a step's trainer
    calls run in worker threads, which `wait_all_tasks_blocked` alone does not wait for)."""
    with anyio.fail_after(30):
        while loop.progress.step < step:
            await anyio.sleep(0.01)
    await anyio.wait_all_tasks_blocked()


def evaluating_loop(loop_config, *overrides):
    """A loop whose source's evaluations wait for the test, over a pipelined bridge whose syncs
    finish at once; returns the loop, the bridge and the source."""
    bridge, source = PipelinedBridge(), GatedEvalSource()
    bridge.release.set()
    source.policy = bridge.policy  # what the engines serve when an evaluation begins
    loop = loop_with(loop_config, "source.overlap=true", "eval.size=4", *overrides, bridge=bridge, source=source)
    return loop, bridge, source


async def feed(loop, count: int, *, start: int = 0, until_step: int | None = None) -> None:
    """Put `count` groups in the buffer, then (with `until_step`) wait until that step is done."""
    for group in groups(count, start=start):
        await loop.buffer.put(group)
    if until_step is not None:
        await settled_at(loop, until_step)


async def test_an_evaluation_beside_training_holds_the_engines_version_and_the_sync_follows_it(loop_config):
    loop, bridge, source = evaluating_loop(loop_config, "train.steps=4")
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        await feed(loop, 4, until_step=2)
        # The start evaluation runs; steps 1 and 2 trained beside it, their syncs held back.
        assert source.evaluations == [4] and loop.progress.step == 2 and bridge.syncs == []
        assert loop.reporter.status()["evaluation"]["when"] == "start"
        source.gate.set()
        await anyio.wait_all_tasks_blocked()
        await feed(loop, 4, start=4)
    records = loop.reporter.metrics.read()
    steps = [r for r in records if r["kind"] == "step"]
    assert [s["sync_deferred"] for s in steps] == [True, True, False, False]
    assert [s["policy_version"] for s in steps] == [0, 0, 0, 1], "the owed sync runs at step 3"
    assert bridge.syncs == [(1, False), (2, False)]
    (start_eval,) = [r for r in records if r["kind"] == "eval"]
    assert (start_eval["step"], start_eval["finished_step"], start_eval["when"]) == (0, 2, "start")
    assert start_eval["eval_s"] >= 0


async def test_the_next_evaluation_measures_its_steps_weights_not_the_version_the_last_one_held(loop_config):
    """eval.every = 2: the start evaluation holds steps 1-2's syncs; the step-2 evaluation waits for
    it, then the held-back sync runs, so it evaluates step 2's weights (version 1)."""
    loop, bridge, source = evaluating_loop(loop_config, "train.steps=3", "eval.every=2")
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        await feed(loop, 4, until_step=2)
        assert bridge.syncs == [] and source.evaluations == [4], "step 2's evaluation waits for the start one"
        source.gate.set()
        await feed(loop, 2, start=4)
    evals = [r for r in loop.reporter.metrics.read() if r["kind"] == "eval"]
    assert [(e["step"], e["policy_version"]) for e in evals] == [(0, 0), (2, 1)]
    assert bridge.syncs[0] == (1, False), "the held-back sync, before the step-2 evaluation began"


async def test_an_evaluation_off_the_sync_cadence_measures_the_trainers_step_not_the_last_synced_one(loop_config):
    """sync_every = 4, eval.every = 3: at step 3 the engines still serve step 0's weights. The
    evaluation due there ships steps 1-3 first (it was recorded as step 3's while measuring step
    0's), and the run's end ships step 5, off the cadence, before its final evaluation."""
    loop, bridge, source = evaluating_loop(loop_config, "train.steps=5", "eval.every=3", "eval.overlap=false")
    bridge.sync_every = 4
    source.gate.set()
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        await feed(loop, 4, until_step=2)
        assert (loop.progress.step, loop.served_step, bridge.syncs) == (2, 0, []), "off the cadence: nothing synced"
        await feed(loop, 6, start=4)
    evals = [r for r in loop.reporter.metrics.read() if r["kind"] == "eval"]
    assert [(e["when"], e["step"], e["policy_version"]) for e in evals] == [("start", 0, 0), ("periodic", 3, 1)]
    assert bridge.syncs == [(1, False), (2, False), (3, False)], "before step 3's evaluation, step 4's, the run's end"
    assert loop.served_step == 5


async def test_an_operators_sync_at_the_boundary_pays_the_sync_an_evaluation_held_back(loop_config):
    """sync_every = 2: step 2's sync is held back by the start evaluation; `ctl sync` while the
    loop waits for a batch ships it, so step 3 owes nothing and the next sync is step 4's."""
    loop, bridge, source = evaluating_loop(loop_config, "train.steps=4")
    bridge.sync_every = 2
    replies = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        await feed(loop, 4, until_step=2)
        assert bridge.syncs == [] and loop.syncs.schedule.owed
        source.gate.set()
        replies.append(await loop.desk.ctl_sync({}))
        await feed(loop, 4, start=4)
    assert replies[0]["forced"] and bridge.syncs == [(1, True), (2, False)]
    steps = [r for r in loop.reporter.metrics.read() if r["kind"] == "step"]
    assert [s["sync_s"] is not None for s in steps] == [False, False, False, True]
    assert [s["sync_deferred"] for s in steps] == [False, True, False, False]


async def test_a_run_that_ends_during_an_evaluation_waits_for_it_then_syncs_what_it_held_back(loop_config):
    loop, bridge, source = evaluating_loop(loop_config, "train.steps=1")
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        await feed(loop, 2, until_step=1)
        assert loop.progress.step == 1 and bridge.syncs == [] and source.evaluations == [4]
        source.gate.set()
    assert bridge.syncs == [(1, False)], "the sync the evaluation held back, once it ended"
    assert [r["kind"] for r in loop.reporter.metrics.read()] == ["step", "eval", "sync"]


async def test_a_stop_abandons_an_evaluation_running_beside_training(loop_config):
    loop, _, source = evaluating_loop(loop_config, "train.steps=5")
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        await anyio.wait_all_tasks_blocked()
        loop.desk.request_stop("test")
    assert source.evaluations == [4] and loop.evaluations.describe() is None
    assert [r["kind"] for r in loop.reporter.metrics.read()] == [], "no result from an abandoned evaluation"


async def test_without_eval_overlap_the_loop_waits_for_each_evaluation(loop_config):
    loop, bridge, source = evaluating_loop(loop_config, "train.steps=1", "eval.overlap=false")
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        await feed(loop, 2)
        await anyio.wait_all_tasks_blocked()
        assert loop.progress.step == 0 and source.evaluations == [4], "waiting for the start evaluation"
        source.gate.set()
    assert bridge.syncs == [(1, False)]
    assert [r["kind"] for r in loop.reporter.metrics.read()] == ["eval", "step", "sync"]


class ThreadsEngine:
    """A local engine whose thread changes land in the trainer's event list (one timeline)."""

    node, name = "local", "engine-0"

    def __init__(self, events: list[str]) -> None:
        self.client, self.threads, self.events = object(), None, events

    async def set_threads(self, threads: int) -> None:
        self.events.append(f"engine threads {threads}")
        self.threads = threads


async def test_the_engine_holds_the_trainers_cores_while_the_loop_waits_and_returns_them_before_training(loop_config):
    from grpod.inference.cores import CoreLoan

    trainer = FakeTrainer()
    loop = loop_with(loop_config, "train.steps=2", "source.overlap=true", trainer=trainer)
    loop.cores = CoreLoan([ThreadsEngine(trainer.events)], own=1, borrowed=2, reason="on")
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop.run)
        await anyio.wait_all_tasks_blocked()
        assert trainer.events == ["engine threads 2"], "lent while no batch is there"
        await loop.desk.ctl_pause({})  # two steps' worth arrive at once: the second waits for nothing
        for group in groups(4):
            await loop.buffer.put(group)
        await anyio.wait_all_tasks_blocked()
        await loop.desk.ctl_resume({})
    assert trainer.events == ["engine threads 2", "engine threads 1", "plan", "prepare", "apply", "finish",
                              "plan", "prepare", "apply", "finish"]
    steps = [r for r in loop.reporter.metrics.read() if r["kind"] == "step"]
    assert steps[0]["batch_wait_s"] > 0 and loop.cores.describe()["loans"] == 1


class IdleEngine:
    node, available, outstanding = "local", True, 0


async def test_the_trainer_gets_the_idle_engines_cores_only_while_generation_is_parked(loop_config):
    from grpod.inference.cores import CoreLoan

    engine, trainer = IdleEngine(), FakeTrainer()
    loop = loop_with(loop_config, "train.steps=1", "source.overlap=true", trainer=trainer)
    loop.cores = CoreLoan([], own=1, borrowed=1, reason="off", idle=[engine], trainer_own=1, trainer_borrowed=2,
                          trainer_reason="on")
    for group in groups(loop.buffer.capacity - 1):
        await loop.buffer.put(group)
    assert loop.trainer_threads() == 1, "the queue has room: a worker is about to send a request"
    await loop.buffer.put(groups(1, start=99)[0])
    assert loop.trainer_threads() == 2, "queue full, nothing outstanding: the engine has nothing to do"
    engine.outstanding = 1
    assert loop.trainer_threads() == 1, "a request still generating"
    engine.outstanding = 0
    loop.evaluations._running = {"when": "periodic", "step": 0, "began": 0.0}
    assert loop.trainer_threads() == 1, "an evaluation beside training samples from the engine"
    loop.evaluations._running = None
    await loop.run()
    assert trainer.threads_now == loop.trainer_threads, "the loop hands the trainer its question"

    synchronous = loop_with(loop_config, "train.steps=1", "source.overlap=false")
    synchronous.cores = loop.cores
    assert synchronous.trainer_threads() == 2, "no overlap: nothing generates while the step trains"


class FullDiskStore:
    """A store whose disk is full for the first `failures` saves."""

    def __init__(self, failures: int) -> None:
        self.failures, self.saved = failures, []

    def save(self, trainer, snapshot):
        from pathlib import Path

        from grpod.run.checkpoint import CheckpointDiskFull

        if self.failures:
            self.failures -= 1
            path = Path(f"/run/x/step-{snapshot.step:06d}/trainer_state.pt")
            raise CheckpointDiskFull(f"no space left on /run/x (tmpfs) writing {path}", mount=Path("/run/x"), path=path)
        self.saved.append(snapshot.step)
        return f"checkpoint-{snapshot.step}"


async def test_a_periodic_checkpoint_out_of_space_raises_the_alarm_and_training_goes_on(loop_config):
    """Issue #30, 8: the run trains on, the next periodic checkpoint retries and clears the alarm."""
    loop = loop_with(loop_config, "train.steps=4", "checkpoint.every=1", source=ListSource(groups(8)))
    loop.store = FullDiskStore(failures=2)
    seen = []
    real = loop.reporter.checkpoint_alarm.failed

    def failed(step, error):
        real(step, error)
        seen.append(loop.reporter.status()["alarms"]["checkpoint"]["active"])

    loop.reporter.checkpoint_alarm.failed = failed
    await loop.run()
    assert loop.progress.step == 4 and loop.progress.stop_reason == "steps done"
    assert loop.store.saved == [3, 4] and seen == [True, True]
    alarm = loop.reporter.status()["alarms"]["checkpoint"]
    assert alarm == {"active": False, "since_step": None, "failures": 2, "raised": 1,
                     "last_error": "no space left on /run/x (tmpfs) writing /run/x/step-000002/trainer_state.pt"}


async def test_a_broken_trainer_stops_the_run_at_its_checkpoint(loop_config):
    """Issue #30, 2: BrokenTrainerState is not survived like a full disk: the run stops with it."""
    from grpod.run.store import BrokenTrainerState

    class BrokenStore:
        def save(self, trainer, snapshot):
            raise BrokenTrainerState("checkpoint of step 1 refused: the trainer is broken")

    loop = loop_with(loop_config, "train.steps=4", "checkpoint.every=1", source=ListSource(groups(8)))
    loop.store = BrokenStore()
    with pytest.raises(BaseException) as caught:
        await loop.run()
    assert "the trainer is broken" in repr(caught.value)
    assert loop.progress.step == 1


class WaitingFillSource(IdleSource):
    """A source whose `fill` waits until the test opens `gate` (Atropos's waits for a batch as long
    as it takes), then delivers; each fill waits for a new gate. `fill_cancel_safe` as the test says."""

    def __init__(self, *, cancel_safe: bool) -> None:
        super().__init__(groups(4))
        self.fill_cancel_safe = cancel_safe
        self.gate = anyio.Event()
        self.fills = 0

    async def fill(self, buffer, count: int) -> None:
        self.fills += 1
        await self.gate.wait()
        self.gate = anyio.Event()  # the next fill waits again
        await super().fill(buffer, count)


async def test_without_overlap_a_waiting_fill_serves_the_operator_and_a_stop(loop_config):
    """source.overlap = false, the source's fill waiting for data: `ctl checkpoint` is answered
    and `ctl stop` ends the loop, the fill cancelled (it is safe to cancel, as Atropos's is)."""
    source = WaitingFillSource(cancel_safe=True)
    loop = loop_with(loop_config, "train.steps=3", source=source)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(loop.run)
            await anyio.wait_all_tasks_blocked()
            info = await loop.desk.ctl_checkpoint({})
            assert info["step"] == 0, "answered while the fill waits"
            await anyio.wait_all_tasks_blocked()
            assert source.fills == 2, "the fill was cancelled for the checkpoint, then asked again"
            await loop.desk.ctl_stop({})
    assert loop.progress.step == 0 and loop.progress.stop_reason == "ctl stop" and len(source.groups) == 4


async def test_without_overlap_a_fill_not_safe_to_cancel_finishes_before_a_request_but_not_before_a_stop(loop_config):
    """A sampling source's fill loses the prompts it drew if cancelled: an operator's request waits
    for it (bounded: a generation), a stop does not."""
    source = WaitingFillSource(cancel_safe=False)
    loop = loop_with(loop_config, "train.steps=3", source=source)
    replies, done = [], anyio.Event()

    async def run():
        await loop.run()
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()

        async def checkpoint():
            replies.append(await loop.desk.ctl_checkpoint({}))

        tg.start_soon(checkpoint)
        await anyio.wait_all_tasks_blocked()
        assert replies == [] and source.fills == 1, "the fill goes on"
        source.gate.set()
        await settled_at(loop, 1)
        assert replies[0]["step"] in (0, 1) and loop.trainer.batches == [["g0", "g1"]]
        assert source.fills == 2
        with anyio.fail_after(10):
            await loop.desk.ctl_stop({})
            await done.wait()
    assert loop.progress.step == 1 and loop.progress.stop_reason == "ctl stop"


async def test_a_stop_after_a_ctl_sync_waiting_for_an_evaluation_ends_the_loop_without_the_sync(loop_config):
    """`ctl sync` waits for the evaluation running beside training; a stop meanwhile abandons the
    evaluation (as without the sync) and answers the sync that the daemon is stopping."""
    loop, bridge, source = evaluating_loop(loop_config, "train.steps=5")
    replies = []

    async def sync():
        try:
            replies.append(await loop.desk.ctl_sync({}))
        except ControlError as exc:
            replies.append(str(exc))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(loop.run)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(sync)
            await anyio.wait_all_tasks_blocked()
            assert replies == [] and loop.evaluations.describe() is not None, "the sync waits for the evaluation"
            await loop.desk.ctl_stop({})
    assert replies == ["the daemon is stopping"] and bridge.syncs == []
    assert loop.evaluations.describe() is None and loop.served_step == 0
