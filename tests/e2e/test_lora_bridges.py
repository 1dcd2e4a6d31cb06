"""Bridge modes `lora_only` and `lora_restart` with a real vLLM (CPU build) serving the tiny model.

Each mode gets one bridge for its class, used by the tests in file order: start serves the
initial adapter under its versioned name; training steps on groups generated through the bridge
(BuiltinSource, with rewards replaced by distinct scores so every group has an advantage) sync
and pass the alignment probe; a long prompt cached before a sync is answered with the new
adapter's logprobs; a step that did not reach vLLM fails the probe; stop leaves no process.
`lora_only` also shows the sync never restarts vLLM, old adapters are unloaded and their
directories pruned, a stale load lands in FAILED and a retried sync recovers, and a killed vLLM
is relaunched with the trained adapter. `lora_restart` (sync_every = 2) shows the step between
syncs is not served and the sync is a relaunch with the new adapter preloaded.
vLLM starts: two for `lora_only`, two for `lora_restart`.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import aiohttp
import anyio
import pytest
import torch

from grpod.bridges.lora_only import LoraOnlyBridge
from grpod.bridges.lora_restart import LoraRestartBridge
from grpod.bridges.probe import ProbeMismatch, ProbeTolerance, probe_sequences, run_probe
from grpod.config import GrpodConfig
from grpod.inference.release import group_members
from grpod.models.tiny import build_model, save_model
from grpod.rollouts.builtin import BuiltinSource
from grpod.rollouts.group import RolloutGroup
from grpod.training.trainer import build_trainer

pytestmark = pytest.mark.e2e

# Longer than one 128-token KV block, so a generation from it can hit vLLM's prefix cache.
LONG_PROMPT = "what is the sum of 3 and 4? it is 7. " * 5 + "and the sum of 5 and 9 is"
# vLLM serving an adapter against HF + PEFT, both fp32: measured within 1e-6 on this model.
LORA_MATCH = 1e-3
# How far a trained adapter must have moved the logprobs for a comparison with it to mean anything.
MOVED = 0.05


def config(root, mode: str, sync_every: int) -> GrpodConfig:
    return GrpodConfig.model_validate(
        {
            "run": {"dir": str(root / "run")},
            "model": {"path": str(root / "model"), "init_if_missing": False},
            "inference": {"start_timeout_s": 300.0, "request_timeout_s": 60.0},
            "train": {
                "lora": True,
                "lr": 1e-2,
                "threads": 1,
                "advantages": {"drop_zero_variance": False},
                "lora_config": {"rank": 8},
            },
            "bridge": {"mode": mode, "keep_adapters": 2, "sync_every": sync_every},
            "source": {"group_size": 4, "max_tokens": 8},
        }
    )


@pytest.fixture(scope="module")
def portal():
    """One event loop for the module: a bridge's HTTP client lives in it across tests."""
    with anyio.from_thread.start_blocking_portal("asyncio") as portal:
        yield portal


def started_bridge(portal, root, bridge_cls, sync_every: int):
    """A started bridge of `bridge_cls` on a fresh tiny model; stopped when the generator ends."""
    model, tokenizer = build_model(seed=0)
    save_model(model, tokenizer, root / "model")
    cfg = config(root, bridge_cls.mode, sync_every)
    trainer = build_trainer(cfg, root / "model")
    bridge = bridge_cls(cfg, root / "run", trainer)
    try:
        probe = portal.call(bridge.start)
        yield bridge, trainer, BuiltinSource(cfg, trainer.tokenizer, bridge), probe
    finally:
        portal.call(bridge.stop)


async def rollout_groups(source: BuiltinSource, count: int) -> list[RolloutGroup]:
    groups = []
    for _ in range(count):
        group = await source.generate_group()
        assert group is not None, f"generation through the bridge failed: {source.stats.drop_reasons}"
        group.scores = [float(k) for k in range(group.size)]
        groups.append(group)
    return groups


def train_step(portal, trainer, source) -> None:
    groups = portal.call(rollout_groups, source, 2)
    metrics = portal.call(anyio.to_thread.run_sync, trainer.train_step, groups)
    assert metrics["skipped"] == 0.0


async def served_and_own(bridge, trainer, model: str | None = None) -> tuple[list[float], list[float]]:
    ids = probe_sequences(trainer.tokenizer)[0]
    served = await bridge.client.score(ids, model=model or bridge.request_model())
    return served, trainer.score(ids)


def max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def registered_adapters(bridge) -> set[str]:
    """The adapter names vLLM lists in /v1/models (the base model `policy` left out)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(bridge.inference.base_url + "/v1/models") as response:
            answer = await response.json()
    return {card["id"] for card in answer["data"]} - {"policy"}


async def sampled_after(bridge, ids: list[int]) -> tuple[int, float]:
    (c,) = await bridge.client.generate(ids, n=1, max_tokens=1, temperature=1.0, seed=5, model=bridge.request_model())
    return c.token_ids[0], c.logprobs[0]


def lora_parameters(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def score_with(trainer, parameters: dict[str, torch.Tensor], ids: list[int]) -> list[float]:
    """The trainer's scores with `parameters` swapped in for its adapter, then swapped back."""
    live = dict(trainer.model.named_parameters())
    current = lora_parameters(trainer)
    with torch.no_grad():
        for name, value in parameters.items():
            live[name].copy_(value)
        try:
            return trainer.score(ids)
        finally:
            for name, value in current.items():
                live[name].copy_(value)


def assert_serves_the_initial_adapter(portal, bridge, probe) -> None:
    assert bridge.state == "SERVING" and probe.ok
    assert portal.call(registered_adapters, bridge) == {"policy-v0"} == {bridge.request_model()}
    assert (bridge.run_dir / "adapters" / "v000000" / "adapter_model.safetensors").exists()
    assert bridge.current_weights == bridge.cfg.model.path, "vLLM's model stays the base"


def assert_stops_clean(portal, bridge) -> None:
    pgid = bridge.inference.pgid
    portal.call(bridge.stop)
    assert bridge.state == "STOPPED" and not bridge.inference.running
    assert group_members(pgid) == []


def assert_probe_sees_the_unsynced_step(portal, bridge, trainer) -> None:
    """The trainer stepped but nothing was synced: the probe on the served adapter must fail."""
    cfg = bridge.cfg.bridge
    probe = functools.partial(
        run_probe, bridge.client, trainer, model=bridge.request_model(), tolerance=ProbeTolerance(max_abs=cfg.probe_tolerance),
        timeout_s=cfg.probe_timeout_s,
    )  # fmt: skip
    result = portal.call(probe)
    assert not result.ok and result.max_abs_diff > cfg.probe_tolerance, result


def assert_no_stale_prefix(portal, bridge, trainer, old_parameters) -> None:
    """After a sync, a prompt cached under the old adapter is answered with the new adapter."""
    ids = trainer.tokenizer(LONG_PROMPT)["input_ids"]
    assert len(ids) > 128
    token, served = portal.call(sampled_after, bridge, ids)
    new = trainer.score(ids + [token])
    old = score_with(trainer, old_parameters, ids + [token])
    assert max_diff(new, old) > MOVED, "the step should change the prompt's logprobs, or the check proves nothing"
    assert abs(served - new[-1]) < LORA_MATCH, (
        f"vLLM served a cached prefix of the old adapter ({served} vs {new[-1]}, old {old[-1]})"
    )


@pytest.fixture(scope="class")
def lora_only_run(portal, tmp_path_factory):
    yield from started_bridge(portal, tmp_path_factory.mktemp("lora-only"), LoraOnlyBridge, sync_every=1)


@pytest.fixture(scope="class")
def lora_restart_run(portal, tmp_path_factory):
    yield from started_bridge(portal, tmp_path_factory.mktemp("lora-restart"), LoraRestartBridge, sync_every=2)


class TestLoraOnly:
    @pytest.fixture
    def run(self, lora_only_run):
        return lora_only_run

    def test_start_serves_the_initial_adapter_under_its_versioned_name(self, run, portal):
        bridge, _, _, probe = run
        assert_serves_the_initial_adapter(portal, bridge, probe)

    def test_syncs_load_a_new_adapter_name_without_restarting_vllm(self, run, portal):
        bridge, trainer, source, _ = run
        pid = bridge.inference.pid
        for step in (1, 2):
            train_step(portal, trainer, source)
            record = portal.call(bridge.after_step, trainer.step)
            assert record.version == step == bridge.policy_version
            assert record.probe["ok"] and record.probe["max_abs_diff"] < LORA_MATCH
            assert {"save", "load", "unload_reset", "probe"} <= set(record.phases)
            assert bridge.request_model() == f"policy-v{step}"
            assert portal.call(registered_adapters, bridge) == {f"policy-v{step}"}, "the old name must be unloaded"
        assert bridge.inference.pid == pid and bridge.stats.restarts == 0
        assert portal.call(bridge.client.weight_version) == "2"
        served, own = portal.call(served_and_own, bridge, trainer)
        base, _ = portal.call(served_and_own, bridge, trainer, "policy")
        assert max_diff(served, own) < LORA_MATCH
        assert max_diff(served, base) > MOVED, "the trained adapter should move the logprobs"

    def test_a_prompt_cached_before_a_sync_gets_the_new_adapters_logprobs(self, run, portal):
        bridge, trainer, source, _ = run
        ids = trainer.tokenizer(LONG_PROMPT)["input_ids"]
        portal.call(sampled_after, bridge, ids)  # caches the prompt's KV blocks under the old adapter
        old = lora_parameters(trainer)
        train_step(portal, trainer, source)
        assert portal.call(bridge.after_step, trainer.step).probe["ok"]
        assert_no_stale_prefix(portal, bridge, trainer, old)

    def test_old_adapter_directories_are_pruned_to_keep_adapters(self, run):
        bridge, _, _, _ = run
        v = bridge.policy_version
        assert v == 3
        assert bridge.adapters.versions() == [v - 1, v]

    def test_the_probe_catches_a_sync_that_did_not_reach_vllm(self, run, portal, monkeypatch):
        bridge, trainer, source, _ = run
        train_step(portal, trainer, source)
        assert_probe_sees_the_unsynced_step(portal, bridge, trainer)

        stale_dir = bridge.adapter.path
        real_load = bridge.client.load_lora_adapter

        async def load_stale(name, path, load_inplace=False):  # a sync that shipped the old weights
            await real_load(name, str(stale_dir), load_inplace)

        monkeypatch.setattr(bridge.client, "load_lora_adapter", load_stale)
        with pytest.raises(ProbeMismatch, match="alignment probe failed"):
            portal.call(bridge.after_step, trainer.step)
        assert bridge.state == "FAILED" and not bridge.available
        monkeypatch.undo()

        record = portal.call(bridge.sync_now)  # the operator's `ctl sync`
        assert record.probe["ok"] and bridge.state == "SERVING" and bridge.available
        assert portal.call(registered_adapters, bridge) == {bridge.request_model()} == {f"policy-v{record.version}"}

    def test_a_killed_vllm_is_relaunched_with_the_current_adapter(self, run, portal):
        bridge, trainer, _, _ = run
        old_pid, name = bridge.inference.pid, bridge.request_model()
        os.killpg(bridge.inference.pgid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while group_members(old_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        portal.call(bridge.recover)
        assert bridge.state == "SERVING" and bridge.inference.pid != old_pid and bridge.stats.restarts == 1
        assert bridge.request_model() == name
        assert portal.call(registered_adapters, bridge) == {name}
        served, own = portal.call(served_and_own, bridge, trainer)
        base, _ = portal.call(served_and_own, bridge, trainer, "policy")
        assert max_diff(served, own) < LORA_MATCH
        assert max_diff(served, base) > MOVED

    def test_stop_leaves_no_process(self, run, portal):
        assert_stops_clean(portal, run[0])


class TestLoraRestart:
    @pytest.fixture
    def run(self, lora_restart_run):
        return lora_restart_run

    def test_start_serves_the_initial_adapter_under_its_versioned_name(self, run, portal):
        bridge, _, _, probe = run
        assert_serves_the_initial_adapter(portal, bridge, probe)

    def test_a_sync_every_second_step_relaunches_vllm_with_the_new_adapter(self, run, portal):
        bridge, trainer, source, _ = run
        assert bridge.cfg.bridge.sync_every == 2
        ids = trainer.tokenizer(LONG_PROMPT)["input_ids"]
        pid = bridge.inference.pid
        portal.call(sampled_after, bridge, ids)  # cached under policy-v0
        old = lora_parameters(trainer)

        train_step(portal, trainer, source)
        assert portal.call(bridge.after_step, trainer.step) is None
        assert bridge.inference.pid == pid and bridge.request_model() == "policy-v0"
        assert_probe_sees_the_unsynced_step(portal, bridge, trainer)

        train_step(portal, trainer, source)
        record = portal.call(bridge.after_step, trainer.step)
        assert record.version == 1 == bridge.policy_version
        assert record.probe["ok"] and record.probe["max_abs_diff"] < LORA_MATCH
        assert {"save", "stop", "launch", "probe"} <= set(record.phases)
        assert bridge.inference.pid != pid and group_members(pid) == []
        assert portal.call(registered_adapters, bridge) == {"policy-v1"} == {bridge.request_model()}
        assert portal.call(bridge.client.weight_version) == "1"
        assert_no_stale_prefix(portal, bridge, trainer, old)
        assert bridge.adapters.versions() == [0, 1]

    def test_stop_leaves_no_process(self, run, portal):
        assert_stops_clean(portal, run[0])
