"""The bridge's sync sequence driven with a scripted vLLM: the two ways of meeting a dead vLLM,
the pipelined sync (trainer half, then vLLM half while the trainer steps) and the probe cadence.

A real vLLM cannot be made to die at one exact await on demand, so `ScriptedProcess` stands in
for the vLLM process an engine launches: its "weights" are one number, its client answers from
them, and its death is an event. Everything else — the bridge's sync sequence, state machine and
probe with its reference, the engine owner (`SupervisedInference`: launch, client lifetime, gate,
health watch, restart budget) — is the real code. The fault suite (`tests/faults/test_vllm_crash.py`)
kills a real vLLM at these points.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from grpod.bridges.base import BridgeFailed, SyncNotSaved
from grpod.bridges.none import NoneBridge
from grpod.bridges.probe import ProbeMismatch
from grpod.config import GrpodConfig
from grpod.errors import first_error
from grpod.inference.process import InferenceStartError
from grpod.inference.supervised import SupervisedInference


class Tokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(range(4))}


class Trainer:
    """Weights are one float; every probe position's logprob is minus that float."""

    tokenizer = Tokenizer()

    def __init__(self) -> None:
        self.weights = 1.0

    def score(self, ids):
        return [-self.weights] * (len(ids) - 1)

    def save_weights(self, target):
        target.mkdir(parents=True)
        (target / "w").write_text(repr(self.weights))
        if getattr(self, "disk_full", False):
            raise OSError(28, "No space left on device", str(target / "model.safetensors"))


class Vllm:
    """A vLLM that serves the weights file it was launched on or reloaded from."""

    def __init__(self, weights_dir) -> None:
        self.weights = float((weights_dir / "w").read_text()) if (weights_dir / "w").exists() else 1.0
        self.alive = True
        self.died = anyio.Event()
        self.die_at: str | None = None
        self.calls: list[str] = []

    def kill(self) -> None:
        self.alive = False
        self.died.set()

    def _call(self, name):
        self.calls.append(name)
        if self.die_at == name:
            self.kill()
        if not self.alive:
            raise ConnectionResetError(f"{name}: connection reset by peer")


class Client:
    def __init__(self, vllm: Vllm) -> None:
        self.vllm = vllm

    async def health(self, timeout_s=None):
        return self.vllm.alive

    async def is_paused(self, timeout_s=None):
        return False  # a scripted vLLM's core always answers; /health says whether it lives

    async def pause(self, mode):
        self.vllm._call("pause")

    async def resume(self):
        self.vllm._call("resume")

    async def collective_rpc(self, method, args=(), kwargs=None):
        assert method == "grpod_reload_weights", method  # vLLM's reload plus the head re-pack
        self.vllm._call(method)
        self.vllm.weights = float((Path(args[0]) / "w").read_text())

    async def end_fence(self, version):
        self.vllm._call("end_fence")

    async def reset_prefix_cache(self):
        self.vllm._call("reset_prefix_cache")

    async def update_weight_version(self, version):
        self.vllm._call("update_weight_version")

    async def score_many(self, sequences, model):
        self.vllm._call("score")
        return [[-self.vllm.weights] * (len(ids) - 1) for ids in sequences]


class ScriptedProcess:
    """Stands in for `InferenceProcess`: each `start` is a new scripted vLLM (kept in `vllms`)."""

    gpu = False
    pid = None
    base_url = "http://127.0.0.1:9"

    def __init__(self) -> None:
        self.vllms: list[Vllm] = []
        self.launched_on: list[Path] = []
        self.current: Vllm | None = None
        self.on_launch = None  # called with each new Vllm

    @property
    def running(self) -> bool:
        return self.current is not None and self.current.alive

    async def start(self, weights, **kwargs) -> None:
        self.current = Vllm(weights)
        self.vllms.append(self.current)
        self.launched_on.append(weights)
        if self.on_launch is not None:
            self.on_launch(self.current)

    async def stop(self) -> None:
        self.current = None

    @asynccontextmanager
    async def client(self):
        yield Client(self.current)

    async def wait_exit(self) -> int:
        await self.current.died.wait()
        return -9


def _bridge(tmp_path, max_restarts=3, probe_every=1) -> NoneBridge:
    cfg = GrpodConfig.model_validate(
        {
            "run": {"dir": str(tmp_path / "run")},
            "model": {"path": str(tmp_path / "model"), "init_if_missing": False},
            "inference": {"max_restarts": max_restarts, "health_interval_s": 0.01, "health_failures": 1},
            "bridge": {"probe_every": probe_every},
        }
    )
    process = ScriptedProcess()
    engine = SupervisedInference(process, cfg.inference)
    bridge = NoneBridge(cfg.bridge, engines=[engine], trainer=Trainer(), model=cfg.model, run_dir=tmp_path / "run")
    bridge.vllms = process.vllms
    bridge.launched_on = process.launched_on
    bridge.process = process
    return bridge


def _events(bridge) -> list[str]:
    return [t.event for t in bridge.machine.history]


async def _started(tmp_path, **kwargs) -> NoneBridge:
    bridge = _bridge(tmp_path, **kwargs)
    await bridge.start()
    return bridge


def test_a_vllm_dying_mid_sync_is_relaunched_on_the_old_weights_and_the_sync_applied_again(tmp_path):
    async def main():
        bridge = await _started(tmp_path)
        bridge.trainer.weights = 2.0
        await bridge.sync_now()
        v1 = bridge.current_weights
        bridge.trainer.weights = 3.0
        bridge.vllms[-1].die_at = "pause"
        record = await bridge.sync_now()
        return bridge, v1, record

    bridge, v1, record = anyio.run(main)
    assert bridge.state == "SERVING" and bridge.policy_version == 2
    assert bridge.restarts == 1 and len(bridge.vllms) == 2
    assert bridge.launched_on[-1] == v1, "relaunched on the weights served before the sync"
    assert bridge.vllms[-1].weights == 3.0, "then the sync was applied to the new vLLM"
    assert _events(bridge)[-5:] == ["SAVED", "LOST", "RETRY", "APPLIED", "PROBE_OK"]
    assert record.probe["ok"] and "recover" in record.phases


def test_a_failure_while_vllm_is_healthy_is_failed_without_a_restart(tmp_path):
    async def main():
        bridge = await _started(tmp_path)
        bridge.trainer.weights = 2.0

        async def refuse(*args, **kwargs):
            raise RuntimeError("reload_weights: shape mismatch")

        bridge.engines[0].client.collective_rpc = refuse
        with pytest.raises(BridgeFailed, match="sync to version 1 failed: reload_weights: shape mismatch"):
            await bridge.sync_now()
        return bridge

    bridge = anyio.run(main)
    assert bridge.state == "FAILED" and bridge.restarts == 0 and len(bridge.vllms) == 1


def test_a_vllm_dying_again_in_the_retried_sync_is_failed(tmp_path):
    async def main():
        bridge = await _started(tmp_path)
        bridge.trainer.weights = 2.0
        bridge.vllms[-1].die_at = "pause"

        def doomed(vllm):
            vllm.die_at = "grpod_reload_weights"

        bridge.process.on_launch = doomed
        with pytest.raises(BridgeFailed, match="sync to version 1 failed"):
            await bridge.sync_now()
        return bridge

    bridge = anyio.run(main)
    assert bridge.state == "FAILED" and bridge.restarts == 1 and bridge.policy_version == 0


def test_the_restart_budget_bounds_mid_sync_recoveries(tmp_path):
    async def main():
        bridge = await _started(tmp_path, max_restarts=0)
        bridge.trainer.weights = 2.0
        bridge.vllms[-1].die_at = "pause"
        with pytest.raises(BridgeFailed, match=r"restart budget \(inference.max_restarts = 0\) is spent"):
            await bridge.sync_now()
        return bridge

    bridge = anyio.run(main)
    assert bridge.state == "FAILED" and len(bridge.vllms) == 1


def test_watch_recovers_between_syncs_against_the_synced_versions_scores(tmp_path):
    """The trainer stepped since the last sync: probing its live weights would fail; the
    relaunched vLLM is compared with the scores recorded when its version was synced."""

    async def main():
        bridge = await _started(tmp_path)
        bridge.trainer.weights = 2.0
        await bridge.sync_now()
        bridge.trainer.weights = 5.0  # trained since, not synced
        bridge.vllms[-1].kill()
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(bridge.watch)
                while len(bridge.vllms) < 2 or bridge.state != "SERVING":
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
        return bridge

    bridge = anyio.run(main)
    assert bridge.restarts == 1 and bridge.policy_version == 1
    assert bridge.vllms[-1].weights == 2.0
    assert _events(bridge)[-3:] == ["LOST", "RECOVERED", "PROBE_OK"]


def test_watch_fails_when_the_budget_is_spent(tmp_path):
    async def main():
        bridge = await _started(tmp_path, max_restarts=0)
        bridge.vllms[-1].kill()
        with anyio.fail_after(10), pytest.raises(BridgeFailed, match="vLLM exited with code -9.*restart budget"):
            await bridge.watch()
        return bridge

    bridge = anyio.run(main)
    assert bridge.state == "FAILED"


class FailingStarts(ScriptedProcess):
    """The next `failures` starts die while starting (as a vLLM OOM-killed or crashing in its
    start-up: InferenceStartError), then starts succeed."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def start(self, weights, **kwargs) -> None:
        if self.failures and self.vllms:  # the first launch (the bridge's start) succeeds
            self.failures -= 1
            raise InferenceStartError("vLLM exited with code -9 during start-up (log tail: Killed)")
        await super().start(weights, **kwargs)


@pytest.mark.parametrize(("failures", "max_restarts", "recovered"), [(2, 3, True), (3, 3, False)])
def test_a_relaunch_that_dies_starting_is_tried_again_within_the_budget(tmp_path, failures, max_restarts, recovered):
    """A lost vLLM whose relaunch dies while starting ended the run at once, budget left or not."""

    async def main():
        bridge = _bridge(tmp_path, max_restarts=max_restarts)
        flaky = FailingStarts(failures)
        bridge.engines[0].process = flaky
        bridge.vllms = flaky.vllms
        await bridge.start()
        flaky.vllms[-1].kill()
        if recovered:
            await _watch_until(bridge, lambda: len(flaky.vllms) >= 2 and bridge.state == "SERVING")
            return bridge
        with anyio.fail_after(10), pytest.raises(BridgeFailed, match="its relaunch failed: vLLM exited with code -9.*restart budget"):
            await bridge.watch()
        return bridge

    bridge = anyio.run(main)
    if recovered:
        assert bridge.restarts == 3 and bridge.state == "SERVING" and len(bridge.vllms) == 2
    else:
        assert bridge.state == "FAILED" and bridge.restarts == 3


def test_a_staged_sync_serves_the_staged_weights_while_the_trainer_steps_on(tmp_path):
    """The vLLM half runs after the trainer moved: it applies and probes what was staged."""

    async def main():
        bridge = await _started(tmp_path)
        bridge.trainer.weights = 2.0
        staged = await bridge.stage_sync()
        assert bridge.state == "APPLYING" and bridge.policy_version == 0
        bridge.trainer.weights = 7.0  # the next step trains before vLLM has the staged weights
        record = await bridge.finish_sync(staged)
        return bridge, record

    bridge, record = anyio.run(main)
    assert bridge.state == "SERVING" and bridge.policy_version == 1
    assert bridge.vllms[-1].weights == 2.0
    assert record.probe["ok"] and record.probe["max_abs_diff"] == 0.0
    assert set(record.phases) >= {"save", "score", "reload", "apply", "probe"}


def test_a_sync_waits_for_the_staged_one_to_finish(tmp_path):
    async def main():
        bridge = await _started(tmp_path)
        bridge.trainer.weights = 2.0
        staged = await bridge.stage_sync()
        bridge.trainer.weights = 3.0
        done: list[str] = []

        async def second_sync():
            await bridge.sync_now()
            done.append("second")

        async def settle():
            await bridge.settled()
            done.append("settled")

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(second_sync)
                tg.start_soon(settle)
                await anyio.sleep(0.05)
                assert done == [] and _events(bridge).count("SYNC") == 1, "nothing passes a sync in flight"
                await bridge.finish_sync(staged)
        return bridge, done

    bridge, done = anyio.run(main)
    assert sorted(done) == ["second", "settled"] and bridge.policy_version == 2
    assert bridge.vllms[-1].weights == 3.0
    assert _events(bridge)[-8:] == ["SYNC", "SAVED", "APPLIED", "PROBE_OK", "SYNC", "SAVED", "APPLIED", "PROBE_OK"]


def test_probe_every_probes_each_nth_sync_and_every_sync_after_a_launch(tmp_path):
    async def main():
        bridge = await _started(tmp_path, probe_every=3)
        records = []
        for weights in (2.0, 3.0, 4.0, 5.0):
            bridge.trainer.weights = weights
            records.append(await bridge.sync_now())
        bridge.trainer.weights = 6.0
        bridge.vllms[-1].die_at = "pause"  # the 5th sync relaunches vLLM: probed though not due
        records.append(await bridge.sync_now())
        return bridge, records

    bridge, records = anyio.run(main)
    probed = [not r.probe.get("skipped") for r in records]
    assert probed == [False, False, True, False, True]
    assert records[0].probe == {"skipped": True, "syncs_since_probe": 1}
    assert _events(bridge).count("PROBE_SKIP") == 3 and bridge.state == "SERVING"
    assert bridge.vllms[0].calls.count("score") == 2, "the start-up probe and the 3rd sync's"


def test_a_broken_unprobed_sync_is_caught_by_the_next_probe(tmp_path):
    async def main():
        bridge = await _started(tmp_path, probe_every=2)
        vllm = bridge.vllms[-1]

        async def reload_ignored(method, args=(), kwargs=None):
            vllm._call(method)  # answers, but the weights stay as they were

        bridge.engines[0].client.collective_rpc = reload_ignored
        bridge.trainer.weights = 2.0
        first = await bridge.sync_now()
        bridge.trainer.weights = 3.0
        with pytest.raises(ProbeMismatch, match="differ from the trainer's by up to 2"):
            await bridge.sync_now()
        return bridge, first

    bridge, first = anyio.run(main)
    assert first.probe["skipped"] and bridge.state == "FAILED"


class SlowProcess(ScriptedProcess):
    """A launch that waits for `go` once armed: a relaunch still loading while the trainer syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.go: anyio.Event | None = None

    async def start(self, weights, **kwargs) -> None:
        if self.go is not None:
            await self.go.wait()
        await super().start(weights, **kwargs)


def _pool(tmp_path, engines: int = 2) -> NoneBridge:
    cfg = GrpodConfig.model_validate(
        {
            "run": {"dir": str(tmp_path / "run")},
            "model": {"path": str(tmp_path / "model"), "init_if_missing": False},
            "inference": {"max_restarts": 3, "health_interval_s": 0.01, "health_failures": 1, "engines": engines},
        }
    )
    processes = [SlowProcess() for _ in range(engines)]
    pool = [SupervisedInference(p, cfg.inference, name=f"engine-{i}") for i, p in enumerate(processes)]
    bridge = NoneBridge(cfg.bridge, engines=pool, trainer=Trainer(), model=cfg.model, run_dir=tmp_path / "run")
    bridge.processes = processes
    return bridge


async def _watch_until(bridge, condition, timeout_s: float = 10.0) -> None:
    """Run the bridge's health watches until `condition()` holds (at most `timeout_s`)."""
    with anyio.fail_after(timeout_s):
        async with anyio.create_task_group() as tg:
            tg.start_soon(bridge.watch)
            while not condition():
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()


@asynccontextmanager
async def _second_relaunching(bridge, timeout_s: float = 10.0):
    """The bridge's health watches running, engine-1 killed and held in its relaunch (its `go`)
    for the block; after it, let go and waited for until it rejoined."""
    second, slow = bridge.engines[1], bridge.processes[1]
    slow.go = slow.go or anyio.Event()
    with anyio.fail_after(timeout_s):
        async with anyio.create_task_group() as tg:
            tg.start_soon(bridge.watch)
            slow.current.kill()
            while not second.recovering:
                await anyio.sleep(0.01)
            yield
            slow.go.set()
            while not second.available:
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()


def test_one_engine_of_a_pool_is_relaunched_while_the_others_sync_then_rejoins_caught_up(tmp_path):
    """Issue #15: one engine dying never pauses training. Its relaunch runs outside the sync
    slot; syncs meanwhile update the others; it rejoins at the current version, after a probe."""

    async def main():
        bridge = _pool(tmp_path)
        await bridge.start()
        first, second = bridge.engines
        async with _second_relaunching(bridge):
            assert not second.available and first.available and bridge.state == "SERVING"
            bridge.trainer.weights = 2.0
            record = await bridge.sync_now()  # the pool syncs without the relaunching engine
            assert record.version == 1 and first.version == 1 and bridge.processes[0].current.weights == 2.0
        return bridge

    bridge = anyio.run(main)
    first, second = bridge.engines
    assert second.version == 1 and not second.recovering and second.restarts == 1 and first.restarts == 0
    relaunched = bridge.processes[1].current
    assert relaunched.weights == 2.0, "caught up to the version synced while it was down"
    assert "score" in relaunched.calls, "probed before it rejoined"
    assert "LOST" not in [t.event for t in bridge.machine.history], "the bridge itself never stopped serving"


def test_an_engine_of_a_pool_dying_mid_sync_leaves_it_and_its_watch_brings_it_back(tmp_path):
    async def main():
        bridge = _pool(tmp_path)
        await bridge.start()
        first, second = bridge.engines
        bridge.processes[1].current.die_at = "pause"
        bridge.trainer.weights = 2.0
        record = await bridge.sync_now()  # engine-1 dies at the fence: the sync goes on without it
        assert record.version == 1 and first.version == 1 and second.recovering and not second.available
        assert bridge.state == "SERVING" and "RETRY" not in [t.event for t in bridge.machine.history]
        await _watch_until(bridge, lambda: second.available)
        return bridge

    bridge = anyio.run(main)
    first, second = bridge.engines
    assert second.version == 1 and second.restarts == 1 and bridge.processes[1].current.weights == 2.0


def test_an_engine_of_a_pool_dying_while_probed_leaves_it_and_the_next_sync_goes_on(tmp_path):
    """Killed after the update, during the sync's probe: the probe cannot reach a verdict on it.
    It leaves the pool (its watch brings it back), the others are probed and serve, and the bridge
    is SERVING for the next sync (a probe left in PROBING refused every later sync)."""

    async def main():
        bridge = _pool(tmp_path)
        await bridge.start()
        first, second = bridge.engines
        bridge.processes[1].current.die_at = "score"
        bridge.trainer.weights = 2.0
        record = await bridge.sync_now()
        assert record.version == 1 and record.probe["ok"] and bridge.state == "SERVING"
        assert second.recovering and not second.available and first.available
        bridge.trainer.weights = 3.0
        again = await bridge.sync_now()
        assert again.version == 2 and bridge.processes[0].current.weights == 3.0
        await _watch_until(bridge, lambda: second.available)
        return bridge

    bridge = anyio.run(main)
    second = bridge.engines[1]
    assert second.version == 2 and second.restarts == 1 and bridge.processes[1].current.weights == 3.0


def test_a_relaunched_engine_of_a_pool_dying_while_it_rejoins_is_relaunched_again_by_its_watch(tmp_path):
    """Its watch relaunched it, and the new launch died while probed before it rejoined: the error
    came out of the watches as it was (not a BridgeFailed), and the run ended with no checkpoint and
    restarts left in the budget. Now that launch is lost like any other: relaunched again, within
    the budget, and it rejoins."""

    async def main():
        bridge = _pool(tmp_path)
        await bridge.start()
        second = bridge.engines[1]
        doomed = [True]

        def launched(vllm):
            if doomed[0]:
                doomed[0] = False
                vllm.die_at = "score"  # the first relaunch dies in its rejoining probe

        bridge.processes[1].on_launch = launched
        bridge.processes[1].current.kill()
        await _watch_until(bridge, lambda: second.available and second.restarts == 2)
        return bridge

    bridge = anyio.run(main)
    first, second = bridge.engines
    assert second.restarts == 2 and not second.recovering and bridge.state == "SERVING"
    assert len(bridge.processes[1].vllms) == 3 and "score" in bridge.processes[1].current.calls
    assert "FAIL" not in [t.event for t in bridge.machine.history]


def test_a_relaunched_engine_that_cannot_rejoin_for_another_reason_fails_the_bridge(tmp_path):
    """Not a death (its catch-up refused, the engine answers /health): a BridgeFailed, which the
    daemon stops on with its checkpoint, not an error out of the watches."""

    async def main():
        bridge = _pool(tmp_path)
        await bridge.start()
        bridge.trainer.weights = 2.0
        slow = bridge.processes[1]
        slow.go = anyio.Event()

        async with anyio.create_task_group() as tg:
            tg.start_soon(bridge.watch)
            slow.current.kill()
            while not bridge.engines[1].recovering:
                await anyio.sleep(0.01)
            await bridge.sync_now()  # version 1 lands while it relaunches: it must catch up

            async def fail_apply(engine, staged, version, phases):
                raise RuntimeError("reload refused")

            bridge._apply = fail_apply
            slow.go.set()
            await anyio.sleep(2)
            tg.cancel_scope.cancel()
        return bridge

    with pytest.raises(BaseException) as caught:
        anyio.run(main)
    failed = first_error(caught.value, BridgeFailed)
    assert failed is not None and "engine-1 was relaunched" in str(failed) and "reload refused" in str(failed), caught.value


def test_the_weights_a_relaunch_loads_are_not_pruned_by_the_syncs_that_land_while_it_starts(tmp_path):
    """A pool engine's relaunch reads the current weights (version 1) when it begins; vLLM loads
    them for 10-100 s. Two syncs landing meanwhile pruned version 1 (two versions are kept), and the
    launch found no weights: a failed start, a restart spent. What a launch in progress reads is
    kept until it returns; the next prune after it removes it."""

    async def main():
        bridge = _pool(tmp_path)
        await bridge.start()
        bridge.trainer.weights = 2.0
        await bridge.sync_now()
        slow = bridge.processes[1]
        slow.go = anyio.Event()
        seen = {}
        start = slow.start

        async def loading(weights, **kwargs):
            await slow.go.wait()
            seen[Path(weights)] = (Path(weights) / "w").exists()
            slow.go = None
            await start(weights, **kwargs)

        slow.start = loading
        async with _second_relaunching(bridge):
            for weights in (3.0, 4.0):
                bridge.trainer.weights = weights
                await bridge.sync_now()
        assert seen == {tmp_path / "run" / "weights" / "v000001": True}, seen
        assert bridge.launching == {}, "nothing in use once the launch returned"
        bridge.trainer.weights = 5.0
        await bridge.sync_now()
        return bridge

    bridge = anyio.run(main)
    second = bridge.engines[1]
    assert second.restarts == 1 and bridge.processes[1].current.weights == 5.0


def test_the_last_serving_engine_of_a_pool_dying_mid_sync_is_relaunched_within_it(tmp_path):
    """engine-1 is being relaunched by its watch when engine-0, the last one serving, dies at the
    sync's pause. It used to leave as any engine of a pool does: the sync then had no member, still
    published version 1 (which no engine served) and failed the run on a probe of no engine. Now
    it is relaunched within the sync, as the only engine is, and the sync lands on it."""

    async def main():
        bridge = _pool(tmp_path)
        await bridge.start()
        first = bridge.engines[0]
        async with _second_relaunching(bridge):
            bridge.processes[0].current.die_at = "pause"
            bridge.trainer.weights = 2.0
            record = await bridge.sync_now()
            assert record.version == 1 and record.probe["ok"] and bridge.state == "SERVING"
            assert first.version == 1 and first.available and bridge.processes[0].current.weights == 2.0
        return bridge

    bridge = anyio.run(main)
    first, second = bridge.engines
    assert first.restarts == 1 and second.restarts == 1 and second.version == 1
    events = [t.event for t in bridge.machine.history]
    assert "FAIL" not in events and events.count("LOST") == 1 and "RETRY" in events, events


def test_the_only_engine_dying_while_probed_is_failed_with_the_reason(tmp_path):
    async def main():
        bridge = await _started(tmp_path)
        bridge.vllms[-1].die_at = "score"
        bridge.trainer.weights = 2.0
        with pytest.raises(BridgeFailed, match="alignment probe at policy version 1 failed: ConnectionResetError"):
            await bridge.sync_now()
        return bridge

    bridge = anyio.run(main)
    assert bridge.state == "FAILED"


def test_a_sync_whose_weights_cannot_be_written_touches_no_engine_and_the_next_one_retries(tmp_path):
    """Disk full (or read-only) under run.dir/weights: the sync is not written, the engines serve
    the version they had, the bridge serves on (it used to be FAILED: the run ended), the pool's
    turn is free and the half-written version is gone; the next sync, with space again, lands."""

    async def main():
        bridge = _pool(tmp_path)
        await bridge.start()
        bridge.trainer.weights, bridge.trainer.disk_full = 2.0, True
        calls = [list(p.current.calls) for p in bridge.processes]
        with pytest.raises(SyncNotSaved, match="sync to version 1 not written: .*No space left on device"):
            await bridge.sync_now()
        assert bridge.state == "SERVING" and bridge.policy.version == 0 and bridge.pool.turn.value == 1
        assert [p.current.calls for p in bridge.processes] == calls, "no engine touched"
        assert all(p.current.weights == 1.0 for p in bridge.processes)
        assert all(e.available for e in bridge.engines)
        assert not any((tmp_path / "run" / "weights").glob("*1*")), "no partial version left"
        bridge.trainer.disk_full = False
        record = await bridge.sync_now()
        assert record.version == 1 and all(p.current.weights == 2.0 for p in bridge.processes)
        return bridge

    bridge = anyio.run(main)
    events = [t.event for t in bridge.machine.history]
    assert "NOT_SAVED" in events and "FAIL" not in events
