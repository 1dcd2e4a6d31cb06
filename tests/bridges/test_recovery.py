"""The bridge's sync sequence driven with a scripted vLLM: the two ways of meeting a dead vLLM,
the pipelined sync (trainer half, then vLLM half while the trainer steps) and the probe cadence.

A real vLLM cannot be made to die at one exact await on demand, so `ScriptedBridge` replaces the
launch, the health answer and the HTTP client of the `none` bridge with a scripted engine whose
"weights" are one number; everything else (sync sequence, state machine, restart budget, probe
with its reference) is the real code. The fault suite (`tests/faults/test_vllm_crash.py`) kills a
real vLLM at these points.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from grpod.bridges.base import BridgeFailed
from grpod.bridges.probe import ProbeMismatch
from grpod.bridges.none import NoneBridge
from grpod.config import GrpodConfig


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


class Engine:
    """A vLLM that serves the weights file it was launched on or reloaded from."""

    def __init__(self, weights_dir) -> None:
        self.weights = float((weights_dir / "w").read_text()) if (weights_dir / "w").exists() else 1.0
        self.alive = True
        self.die_at: str | None = None
        self.calls: list[str] = []

    def _call(self, name):
        self.calls.append(name)
        if self.die_at == name:
            self.alive = False
        if not self.alive:
            raise ConnectionResetError(f"{name}: connection reset by peer")


class Client:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def pause(self, mode):
        self.engine._call("pause")

    async def resume(self):
        self.engine._call("resume")

    async def collective_rpc(self, method, args=(), kwargs=None):
        assert method == "grpod_reload_weights", method  # vLLM's reload plus the head re-pack
        self.engine._call(method)
        self.engine.weights = float((Path(args[0]) / "w").read_text())

    async def end_fence(self, version):
        self.engine._call("end_fence")

    async def reset_prefix_cache(self):
        self.engine._call("reset_prefix_cache")

    async def update_weight_version(self, version):
        self.engine._call("update_weight_version")

    async def score_many(self, sequences, model):
        self.engine._call("score")
        return [[-self.engine.weights] * (len(ids) - 1) for ids in sequences]


class ScriptedBridge(NoneBridge):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.engines: list[Engine] = []
        self.launched_on: list = []

    async def _launch(self, weights) -> None:
        engine = Engine(weights)
        self.engines.append(engine)
        self.launched_on.append(weights)
        self.client = Client(engine)

    async def _shutdown_inference(self) -> None:
        self._close()
        self.client = None

    async def _engine_healthy(self) -> bool:
        return self.client is not None and self.client.engine.alive


def _bridge(tmp_path, max_restarts=3, probe_every=1) -> ScriptedBridge:
    cfg = GrpodConfig.model_validate(
        {
            "run": {"dir": str(tmp_path / "run")},
            "model": {"path": str(tmp_path / "model"), "init_if_missing": False},
            "inference": {"max_restarts": max_restarts, "health_interval_s": 0.01, "health_failures": 1},
            "bridge": {"probe_every": probe_every},
        }
    )
    return ScriptedBridge(cfg, tmp_path / "run", Trainer())


def _events(bridge) -> list[str]:
    return [t.event for t in bridge.machine.history]


async def _started(tmp_path, **kwargs) -> ScriptedBridge:
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
        bridge.engines[-1].die_at = "pause"
        record = await bridge.sync_now()
        return bridge, v1, record

    bridge, v1, record = anyio.run(main)
    assert bridge.state == "SERVING" and bridge.policy_version == 2
    assert bridge.stats.restarts == 1 and len(bridge.engines) == 2
    assert bridge.launched_on[-1] == v1, "relaunched on the weights served before the sync"
    assert bridge.engines[-1].weights == 3.0, "then the sync was applied to the new vLLM"
    assert _events(bridge)[-5:] == ["SAVED", "LOST", "RETRY", "APPLIED", "PROBE_OK"]
    assert record.probe["ok"] and "recover" in record.phases


def test_a_failure_while_vllm_is_healthy_is_failed_without_a_restart(tmp_path):
    async def main():
        bridge = await _started(tmp_path)
        bridge.trainer.weights = 2.0

        async def refuse(*args, **kwargs):
            raise RuntimeError("reload_weights: shape mismatch")

        bridge.client.collective_rpc = refuse
        with pytest.raises(BridgeFailed, match="sync to version 1 failed: reload_weights: shape mismatch"):
            await bridge.sync_now()
        return bridge

    bridge = anyio.run(main)
    assert bridge.state == "FAILED" and bridge.stats.restarts == 0 and len(bridge.engines) == 1


def test_a_vllm_dying_again_in_the_retried_sync_is_failed(tmp_path):
    async def main():
        bridge = await _started(tmp_path)
        bridge.trainer.weights = 2.0
        bridge.engines[-1].die_at = "pause"
        original = bridge._launch

        async def launch_doomed(weights):
            await original(weights)
            bridge.engines[-1].die_at = "grpod_reload_weights"

        bridge._launch = launch_doomed
        with pytest.raises(BridgeFailed, match="sync to version 1 failed"):
            await bridge.sync_now()
        return bridge

    bridge = anyio.run(main)
    assert bridge.state == "FAILED" and bridge.stats.restarts == 1 and bridge.policy_version == 0


def test_the_restart_budget_bounds_mid_sync_recoveries(tmp_path):
    async def main():
        bridge = await _started(tmp_path, max_restarts=0)
        bridge.trainer.weights = 2.0
        bridge.engines[-1].die_at = "pause"
        with pytest.raises(BridgeFailed, match=r"restart budget \(inference.max_restarts = 0\) is spent"):
            await bridge.sync_now()
        return bridge

    bridge = anyio.run(main)
    assert bridge.state == "FAILED" and len(bridge.engines) == 1


def test_watch_recovers_between_syncs_against_the_synced_versions_scores(tmp_path):
    """The trainer stepped since the last sync: probing its live weights would fail; the
    relaunched vLLM is compared with the scores recorded when its version was synced."""

    async def main():
        bridge = await _started(tmp_path)
        bridge.trainer.weights = 2.0
        await bridge.sync_now()
        bridge.trainer.weights = 5.0  # trained since, not synced
        bridge.engines[-1].alive = False
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(bridge.watch)
                while len(bridge.engines) < 2 or bridge.state != "SERVING":
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
        return bridge

    bridge = anyio.run(main)
    assert bridge.stats.restarts == 1 and bridge.policy_version == 1
    assert bridge.engines[-1].weights == 2.0
    assert _events(bridge)[-3:] == ["LOST", "RECOVERED", "PROBE_OK"]


def test_watch_fails_when_the_budget_is_spent(tmp_path):
    async def main():
        bridge = await _started(tmp_path, max_restarts=0)
        bridge.engines[-1].alive = False
        with anyio.fail_after(10), pytest.raises(BridgeFailed, match="inference engine dead or unresponsive"):
            await bridge.watch()
        return bridge

    bridge = anyio.run(main)
    assert bridge.state == "FAILED"


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
    assert bridge.engines[-1].weights == 2.0
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
    assert bridge.engines[-1].weights == 3.0
    assert _events(bridge)[-8:] == ["SYNC", "SAVED", "APPLIED", "PROBE_OK", "SYNC", "SAVED", "APPLIED", "PROBE_OK"]


def test_probe_every_probes_each_nth_sync_and_every_sync_after_a_launch(tmp_path):
    async def main():
        bridge = await _started(tmp_path, probe_every=3)
        records = []
        for weights in (2.0, 3.0, 4.0, 5.0):
            bridge.trainer.weights = weights
            records.append(await bridge.sync_now())
        bridge.trainer.weights = 6.0
        bridge.engines[-1].die_at = "pause"  # the 5th sync relaunches vLLM: probed though not due
        records.append(await bridge.sync_now())
        return bridge, records

    bridge, records = anyio.run(main)
    probed = [not r.probe.get("skipped") for r in records]
    assert probed == [False, False, True, False, True]
    assert records[0].probe == {"skipped": True, "syncs_since_probe": 1}
    assert _events(bridge).count("PROBE_SKIP") == 3 and bridge.state == "SERVING"
    assert bridge.engines[0].calls.count("score") == 2, "the start-up probe and the 3rd sync's"


def test_a_broken_unprobed_sync_is_caught_by_the_next_probe(tmp_path):
    async def main():
        bridge = await _started(tmp_path, probe_every=2)
        engine = bridge.engines[-1]

        async def reload_ignored(method, args=(), kwargs=None):
            engine._call(method)  # answers, but the weights stay as they were

        bridge.client.collective_rpc = reload_ignored
        bridge.trainer.weights = 2.0
        first = await bridge.sync_now()
        bridge.trainer.weights = 3.0
        with pytest.raises(ProbeMismatch, match="differ from the trainer's by up to 2"):
            await bridge.sync_now()
        return bridge, first

    bridge, first = anyio.run(main)
    assert first.probe["skipped"] and bridge.state == "FAILED"
