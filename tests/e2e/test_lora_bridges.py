"""Bridge modes `lora_only` and `lora_restart` with a real vLLM (CPU build) serving the tiny model.

Each mode is one test, a whole run from start to stop on its own vLLM (so each passes alone and
in any selection): start serves the initial adapter under its versioned name (and `/generate`
samples it); training steps on groups generated through the bridge (the builtin source, with
rewards replaced by distinct scores so every group has an advantage) sync and pass the alignment
probe; a long prompt cached before a sync is answered with the new adapter's logprobs; a step
that did not reach vLLM fails the probe; stop leaves no process. `lora_only` also shows the sync
never restarts vLLM, old adapters are unloaded and their directories pruned, a stale load lands
in FAILED and a retried sync recovers, and a killed vLLM is relaunched with the trained adapter.
`lora_restart` (sync_every = 2) shows the step between syncs is not served and the sync is a
relaunch with the new adapter preloaded. vLLM starts: two for `lora_only`, two for `lora_restart`.
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

from grpod.bridges.probe import (
    ProbeMismatch,
    ProbeTolerance,
    probe_sequences,
    run_probe,
)
from grpod.config import GrpodConfig
from grpod.inference.release import group_members
from grpod.models.tiny import build_model, save_model
from grpod.rollouts.group import RolloutGroup
from grpod.training.trainer import build_trainer
from tests.e2e.conftest import bridge_for, source_for

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


@pytest.fixture()
def started(portal, tmp_path):
    """`started(mode, sync_every)`: a started bridge on a fresh tiny model, stopped at the end."""
    bridges = []

    def start(mode: str, sync_every: int):
        model, tokenizer = build_model(seed=0)
        save_model(model, tokenizer, tmp_path / "model")
        cfg = config(tmp_path, mode, sync_every)
        trainer = build_trainer(cfg)
        bridge = bridge_for(cfg, tmp_path / "run", trainer)
        bridges.append(bridge)
        probe = portal.call(bridge.start)
        return bridge, trainer, source_for(cfg, trainer.tokenizer, bridge), probe

    yield start
    for bridge in bridges:
        portal.call(bridge.stop)


async def rollout_groups(source, count: int) -> list[RolloutGroup]:
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
    served = await bridge.engines[0].client.score(ids, model=model or bridge.policy.served_name)
    return served, trainer.score(ids)


def max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def registered_adapters(bridge) -> set[str]:
    """The adapter names vLLM lists in /v1/models (the base model `policy` left out)."""
    async with aiohttp.ClientSession() as session:
        async with session.get(bridge.engines[0].process.base_url + "/v1/models") as response:
            answer = await response.json()
    return {card["id"] for card in answer["data"]} - {"policy"}


async def sampled_after(bridge, ids: list[int]) -> tuple[int, float]:
    (c,) = await bridge.engines[0].client.generate(
        ids, n=1, max_tokens=1, temperature=1.0, seed=5, model=bridge.policy.served_name
    )
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


async def generate_route_model(bridge, trainer) -> float:
    """The logprob `/generate` (what Atropos environments call, naming no model) gives the probe's
    second token: it must sample the served adapter, not the base."""
    ids = probe_sequences(trainer.tokenizer)[0]
    body = {"prompt": {"prompt_token_ids": ids}, "max_tokens": 1, "temperature": 1.0, "n": 1, "prompt_logprobs": 0}
    async with aiohttp.ClientSession() as session:
        async with session.post(bridge.engines[0].process.base_url + "/generate", json=body) as response:
            answer = await response.json()
    entry = answer["prompt_logprobs"][1][0]
    return float(entry[str(ids[1])])


def assert_serves_the_initial_adapter(portal, bridge, trainer, probe) -> None:
    assert bridge.state == "SERVING" and probe.ok
    assert portal.call(registered_adapters, bridge) == {"policy-v0"} == {bridge.policy.served_name}
    assert (bridge.run_dir / "adapters" / "v000000" / "adapter_model.safetensors").exists()
    assert bridge.current_weights == bridge.model.path, "vLLM's model stays the base"


def assert_stops_clean(portal, bridge) -> None:
    pgid = bridge.engines[0].process.pgid
    portal.call(bridge.stop)
    assert bridge.state == "STOPPED" and not bridge.engines[0].process.running
    assert group_members(pgid) == []


def assert_probe_sees_the_unsynced_step(portal, bridge, trainer) -> None:
    """The trainer stepped but nothing was synced: the probe on the served adapter must fail."""
    cfg = bridge.cfg
    probe = functools.partial(
        run_probe, bridge.engines[0].client, trainer, model=bridge.policy.served_name,
        tolerance=ProbeTolerance(max_abs=cfg.probe_tolerance), timeout_s=cfg.probe_timeout_s,
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


def test_lora_only_swaps_adapters_in_place_recovers_and_stops_clean(started, portal, monkeypatch):
    bridge, trainer, source, probe = started("lora_only", sync_every=1)
    assert_serves_the_initial_adapter(portal, bridge, trainer, probe)
    own = trainer.score(probe_sequences(trainer.tokenizer)[0])
    assert abs(portal.call(generate_route_model, bridge, trainer) - own[0]) < LORA_MATCH, "/generate samples policy-v0"

    # Syncs load a new adapter name without restarting vLLM.
    pid = bridge.engines[0].process.pid
    for step in (1, 2):
        train_step(portal, trainer, source)
        record = portal.call(bridge.after_step, trainer.step)
        assert record.version == step == bridge.policy_version
        assert record.probe["ok"] and record.probe["max_abs_diff"] < LORA_MATCH
        assert {"save", "load", "unload_reset", "probe"} <= set(record.phases)
        assert bridge.policy.served_name == f"policy-v{step}"
        assert portal.call(registered_adapters, bridge) == {f"policy-v{step}"}, "the old name must be unloaded"
    assert bridge.engines[0].process.pid == pid and bridge.restarts == 0
    assert portal.call(bridge.engines[0].client.weight_version) == "2"
    served, own = portal.call(served_and_own, bridge, trainer)
    base, _ = portal.call(served_and_own, bridge, trainer, "policy")
    assert max_diff(served, own) < LORA_MATCH
    assert max_diff(served, base) > MOVED, "the trained adapter should move the logprobs"
    assert abs(portal.call(generate_route_model, bridge, trainer) - own[0]) < LORA_MATCH, "/generate follows the adapter"

    # A prompt cached before a sync gets the new adapter's logprobs.
    ids = trainer.tokenizer(LONG_PROMPT)["input_ids"]
    portal.call(sampled_after, bridge, ids)  # caches the prompt's KV blocks under the old adapter
    old = lora_parameters(trainer)
    train_step(portal, trainer, source)
    assert portal.call(bridge.after_step, trainer.step).probe["ok"]
    assert_no_stale_prefix(portal, bridge, trainer, old)

    # Old adapter directories are pruned to keep_adapters.
    assert bridge.policy_version == 3 and bridge.adapters.versions() == [2, 3]

    # The probe catches a sync that did not reach vLLM; the operator's `ctl sync` recovers.
    train_step(portal, trainer, source)
    assert_probe_sees_the_unsynced_step(portal, bridge, trainer)
    stale_dir = bridge.adapter.path
    client = bridge.engines[0].client
    real_load = client.load_lora_adapter

    async def load_stale(name, path, load_inplace=False):  # a sync that shipped the old weights
        await real_load(name, str(stale_dir), load_inplace)

    monkeypatch.setattr(client, "load_lora_adapter", load_stale)
    with pytest.raises(ProbeMismatch, match="alignment probe failed"):
        portal.call(bridge.after_step, trainer.step)
    assert bridge.state == "FAILED" and not bridge.available
    monkeypatch.undo()
    record = portal.call(bridge.sync_now)
    assert record.probe["ok"] and bridge.state == "SERVING" and bridge.available
    assert portal.call(registered_adapters, bridge) == {bridge.policy.served_name} == {f"policy-v{record.version}"}

    # A killed vLLM is relaunched with the current adapter.
    engine = bridge.engines[0]
    old_pid, name = engine.process.pid, bridge.policy.served_name
    os.killpg(engine.process.pgid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while group_members(old_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    portal.call(bridge.recover, engine, "killed by the test")
    assert bridge.state == "SERVING" and engine.process.pid != old_pid and bridge.restarts == 1
    assert bridge.policy.served_name == name
    assert portal.call(registered_adapters, bridge) == {name}
    served, own = portal.call(served_and_own, bridge, trainer)
    base, _ = portal.call(served_and_own, bridge, trainer, "policy")
    assert max_diff(served, own) < LORA_MATCH
    assert max_diff(served, base) > MOVED
    assert abs(portal.call(generate_route_model, bridge, trainer) - own[0]) < LORA_MATCH

    assert_stops_clean(portal, bridge)


def test_lora_restart_relaunches_with_each_new_adapter_and_stops_clean(started, portal):
    bridge, trainer, source, probe = started("lora_restart", sync_every=2)
    assert_serves_the_initial_adapter(portal, bridge, trainer, probe)
    ids = trainer.tokenizer(LONG_PROMPT)["input_ids"]
    pid = bridge.engines[0].process.pid
    portal.call(sampled_after, bridge, ids)  # cached under policy-v0
    old = lora_parameters(trainer)

    train_step(portal, trainer, source)
    assert portal.call(bridge.after_step, trainer.step) is None
    assert bridge.engines[0].process.pid == pid and bridge.policy.served_name == "policy-v0"
    assert_probe_sees_the_unsynced_step(portal, bridge, trainer)

    train_step(portal, trainer, source)
    record = portal.call(bridge.after_step, trainer.step)
    assert record.version == 1 == bridge.policy_version
    assert record.probe["ok"] and record.probe["max_abs_diff"] < LORA_MATCH
    assert {"save", "stop", "launch", "probe"} <= set(record.phases)
    assert bridge.engines[0].process.pid != pid and group_members(pid) == []
    assert portal.call(registered_adapters, bridge) == {"policy-v1"} == {bridge.policy.served_name}
    assert portal.call(bridge.engines[0].client.weight_version) == "1"
    assert_no_stale_prefix(portal, bridge, trainer, old)
    assert bridge.adapters.versions() == [0, 1]
    own = trainer.score(probe_sequences(trainer.tokenizer)[0])
    assert abs(portal.call(generate_route_model, bridge, trainer) - own[0]) < LORA_MATCH, "/generate follows the adapter"

    assert_stops_clean(portal, bridge)
