"""Bridge mode `shared` with a real vLLM (CPU build): one copy of the weights for both sides.

One test is one run of a shared bridge (tiny model, tied embeddings, linear rope scaling), from
start to stop, so it passes alone and in any selection: the attach maps every vLLM parameter, a
write through a trainer parameter is what vLLM reads with no reload, fenced training steps (the
step loop's `train_batch`: each optimizer update through `bridge.fence`) sync and probe, a
generation in flight across a step is paused and resumed and leaves no stale cached prefix, a
vLLM killed mid-run is relaunched and re-attached to the trained weights, a sync that did not
reach vLLM fails the probe, and stop removes the /dev/shm directory. A second vLLM on a larger
model measures resident memory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import aiohttp
import anyio
import psutil
import pytest
import torch

from grpod.bridges.probe import ProbeMismatch, probe_sequences
from grpod.bridges.shared import shared_dir
from grpod.config import GrpodConfig
from grpod.daemon.step_loop import train_batch
from grpod.inference.process import InferenceProcess
from grpod.inference.release import group_members
from grpod.models.tiny import build_model, save_model
from grpod.rollouts.group import RolloutGroup
from grpod.training.trainer import build_trainer
from grpod.weights.shared_layout import share_parameters
from tests.e2e.conftest import bridge_for

pytestmark = pytest.mark.e2e

ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
# Longer than one 128-token KV block, so generation from it can hit vLLM's prefix cache.
LONG_PROMPT = "what is the sum of 3 and 4? it is 7. " * 5 + "and the sum of 5 and 9 is"


def config(run_dir, model_dir, **train) -> GrpodConfig:
    return GrpodConfig.model_validate(
        {
            "run": {"dir": str(run_dir)},
            "model": {"path": str(model_dir), "init_if_missing": False},
            "inference": {"start_timeout_s": 300.0, "request_timeout_s": 60.0},
            "train": {"lr": 2e-3, "threads": 1, "advantages": {"drop_zero_variance": False}, **train},
            "bridge": {"mode": "shared"},
            "source": {"max_tokens": 8},
        }
    )


@pytest.fixture()
def run(tmp_path, portal):
    model, tokenizer = build_model(seed=0, tie_word_embeddings=True, rope_scaling=ROPE)
    save_model(model, tokenizer, tmp_path / "model")
    cfg = config(tmp_path / "run", tmp_path / "model")
    trainer = build_trainer(cfg)
    bridge = bridge_for(cfg, tmp_path / "run", trainer)
    try:
        portal.call(bridge.start)
        yield bridge, trainer
    finally:
        portal.call(bridge.stop)


def train_step(portal, bridge, trainer, groups):
    """The daemon's way: the trainer's phases in worker threads, each update through the fence.
    Returns the metrics and the syncs the fence made."""
    return portal.call(train_batch, trainer, bridge, groups)


async def rollout_groups(bridge, trainer, count: int, seed: int) -> list[RolloutGroup]:
    groups = []
    for i in range(count):
        prompt = trainer.tokenizer(f"<|im_start|>user\n{i + 3}+{seed}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
        completions = await bridge.engines[0].client.generate(prompt, n=4, max_tokens=6, temperature=1.0, seed=seed + i)
        groups.append(
            RolloutGroup(
                tokens=[prompt + c.token_ids for c in completions],
                loss_mask=[[0] * len(prompt) + [1] * len(c.token_ids) for c in completions],
                scores=[float(k) for k in range(len(completions))],
                inference_logprobs=[[0.0] * len(prompt) + c.logprobs for c in completions],
                policy_version=bridge.policy_version,
            )
        )
    return groups


async def served_and_own_scores(bridge, trainer) -> tuple[list[float], list[float]]:
    ids = probe_sequences(trainer.tokenizer)[2]
    served = await bridge.engines[0].client.score(ids)
    return served, trainer.score(ids)


def max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def long_generation(base_url: str, streaming: threading.Event) -> tuple[float, dict[int, str]]:
    """Stream a long generation; `streaming` is set at its first token. Returns when it ended and
    each choice's finish reason."""
    body = {"model": "policy", "prompt": [3, 4, 5, 6], "n": 16, "max_tokens": 240, "ignore_eos": True, "stream": True}
    reasons: dict[int, str] = {}
    async with aiohttp.ClientSession() as session:
        async with session.post(base_url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                streaming.set()
                for choice in json.loads(line[6:])["choices"]:
                    if choice.get("finish_reason"):
                        reasons[choice["index"]] = choice["finish_reason"]
    return time.monotonic(), reasons


async def sampled_after(bridge, ids: list[int]) -> tuple[int, float]:
    (c,) = await bridge.engines[0].client.generate(ids, n=1, max_tokens=1, temperature=1.0, seed=5)
    return c.token_ids[0], c.logprobs[0]


def test_shared_weights_serve_fenced_steps_recover_and_stop_clean(run, portal):
    bridge, trainer = run
    client = lambda: bridge.engines[0].client  # noqa: E731 — a relaunch replaces it
    process = bridge.engines[0].process

    # The attach maps every vLLM parameter into the trainer's buffer.
    assert bridge.state == "SERVING"
    assert bridge.shm_dir == shared_dir(bridge.run_dir) and (bridge.shm_dir / "weights.bin").exists()
    (report,) = portal.call(client().collective_rpc, "shared_weights_report")
    assert report["outside"] == [], f"vLLM parameters not in the shared buffer: {report['outside']}"
    assert report["pid"] != os.getpid()
    for name, param in trainer.model.named_parameters():
        assert bridge.shared.holds(param), f"trainer parameter {name} is not a view of the shared buffer"
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight
    served, own = portal.call(served_and_own_scores, bridge, trainer)
    assert max_diff(served, own) < 1e-4

    # A write through a trainer parameter is read by vLLM without a reload.
    before = served
    embed = trainer.model.model.embed_tokens.weight  # also the output head: tied
    k_bias = trainer.model.model.layers[1].self_attn.k_proj.bias
    saved = embed.detach().clone(), k_bias.detach().clone()
    try:
        with torch.no_grad():
            embed.mul_(1.7)
            k_bias.add_(0.3)
        served, own = portal.call(served_and_own_scores, bridge, trainer)
        assert max_diff(served, before) > 0.05, "vLLM did not see the trainer's write"
        assert max_diff(served, own) < 1e-4
    finally:
        with torch.no_grad():
            embed.copy_(saved[0])
            k_bias.copy_(saved[1])
    restored, _ = portal.call(served_and_own_scores, bridge, trainer)
    assert max_diff(restored, before) < 1e-5

    # Fenced training steps sync and pass the probe: the optimizer update is the sync.
    start_version = bridge.policy_version
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for step in range(1, 3):
        groups = portal.call(rollout_groups, bridge, trainer, 2, 10 * step)
        metrics, (record,) = train_step(portal, bridge, trainer, groups)
        assert metrics["skipped"] == 0.0
        assert record.version == start_version + step == bridge.policy_version
        assert record.probe["ok"] and record.probe["max_abs_diff"] < 1e-4
        assert {"pause", "optimizer_step", "reset_resume", "probe"} <= set(record.phases)
        assert not bridge.sync_due(trainer.step), "the fence was the step's one sync"
    assert portal.call(client().weight_version) == str(bridge.policy_version)
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, initial[n])]
    assert len(moved) == len(initial), "every parameter should have trained"
    served, own = portal.call(served_and_own_scores, bridge, trainer)
    assert max_diff(served, own) < 1e-4

    # A generation in flight is paused across the step, and no stale cached prefix survives.
    ids = trainer.tokenizer(LONG_PROMPT)["input_ids"]
    assert len(ids) > 128
    portal.call(sampled_after, bridge, ids)  # caches the prompt's first KV block (old weights)
    groups = portal.call(rollout_groups, bridge, trainer, 2, 77)
    streaming = threading.Event()
    fenced_at: list[float] = []
    bridge_fence = bridge.fence

    async def fence_while_generating(update):
        await anyio.to_thread.run_sync(streaming.wait, 60)
        assert streaming.is_set(), "the long generation never started"
        fenced_at.append(time.monotonic())
        return await bridge_fence(update)

    bridge.fence = fence_while_generating
    try:
        in_flight = portal.start_task_soon(long_generation, process.base_url, streaming)
        _, (record,) = train_step(portal, bridge, trainer, groups)
        finished, reasons = in_flight.result(timeout=120)
    finally:
        bridge.fence = bridge_fence
    assert finished > fenced_at[0], "the generation was not in flight when the fence paused vLLM"
    assert reasons == {i: "length" for i in range(16)}, "every choice must run to max_tokens after the resume"
    assert record.probe["ok"]
    token, served = portal.call(sampled_after, bridge, ids)
    own = trainer.score(ids + [token])[-1]
    assert abs(served - own) < 1e-3, f"vLLM served a cached prefix of the old weights ({served} vs {own})"

    # A killed vLLM is relaunched onto the trained weights (re-attached, no checkpoint needed).
    fresh, _ = build_model(seed=0, tie_word_embeddings=True, rope_scaling=ROPE)
    assert not torch.equal(fresh.model.norm.weight, trainer.model.model.norm.weight), "trainer should have trained"
    old_pid = process.pid
    os.killpg(process.pgid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while group_members(old_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    portal.call(bridge.recover, bridge.engines[0], "killed by the test")
    assert bridge.state == "SERVING" and process.pid != old_pid and bridge.restarts == 1
    assert not (bridge.run_dir / "weights").exists(), "recovery must not need a checkpoint of the trained weights"
    (report,) = portal.call(client().collective_rpc, "shared_weights_report")
    assert report["outside"] == []
    served, own = portal.call(served_and_own_scores, bridge, trainer)
    assert max_diff(served, own) < 1e-4
    assert portal.call(client().weight_version) == str(bridge.policy_version)

    # The probe catches a sync that did not reach vLLM.
    groups = portal.call(rollout_groups, bridge, trainer, 2, 99)
    for param in trainer.model.parameters():  # the trainer now writes memory vLLM does not read
        param.data = param.data.clone()
    with pytest.raises(ProbeMismatch, match="alignment probe failed"):
        train_step(portal, bridge, trainer, groups)
    assert bridge.state == "FAILED"

    # Stop removes the shared directory and vLLM; the trainer's weights outlive them.
    pgid = process.pgid
    portal.call(bridge.stop)
    assert not bridge.shm_dir.exists()
    assert group_members(pgid) == []
    assert bridge.state == "STOPPED"
    assert len(trainer.score([3, 4, 5, 6])) == 3


def outside_and_shared_rss(pid: int, shm_dir, model_dir) -> dict[str, int]:
    """Resident bytes of `pid` from /proc/<pid>/smaps (psutil): in the shared weights file, in the
    checkpoint's files, and everything else."""
    out = {"shm_rss": 0, "shm_pss": 0, "checkpoint_rss": 0, "other_rss": 0}
    for m in psutil.Process(pid).memory_maps(grouped=True):
        if m.path.startswith(str(shm_dir)):
            out["shm_rss"] += m.rss
            out["shm_pss"] += m.pss
        elif m.path.startswith(str(model_dir)):
            out["checkpoint_rss"] += m.rss
        else:
            out["other_rss"] += m.rss
    return out


def test_trainer_and_vllm_hold_one_copy_of_the_weights(tmp_path):
    """Resident weight memory of both processes, shared pages counted once, <= 1.05 x one copy.

    vLLM's own copy is what leaves its non-shared resident memory when it attaches; what does not
    leave counts as a second copy. The trainer's weights start as a private mapping of the
    checkpoint (transformers maps safetensors), made resident by a forward pass: any of it still
    resident after sharing, and any growth of its other memory, counts as a second copy.
    """
    model, tokenizer = build_model(seed=0, hidden_size=1024, layers=4)
    save_model(model, tokenizer, tmp_path / "model")
    del model
    cfg = config(tmp_path / "run", tmp_path / "model")
    shm = shared_dir(tmp_path / "run")
    trainer = build_trainer(cfg, tmp_path / "model")
    me = os.getpid()
    process = InferenceProcess(cfg.inference, cfg.model, tmp_path / "run")

    def measure(pid: int) -> dict[str, int]:
        return outside_and_shared_rss(pid, shm, tmp_path / "model")

    async def measure_both() -> dict:
        trainer.score([3, 4, 5, 6])
        before_trainer = measure(me)
        shared = share_parameters(trainer.model, shm)
        after_trainer = measure(me)
        await process.start(tmp_path / "model", worker_extension="grpod.weights.shared_ext.SharedWeightsExtension")
        async with process.client() as client:
            (report,) = await client.collective_rpc("shared_weights_report")
            before_vllm = measure(report["pid"])
            await client.collective_rpc("attach_shared", args=[str(shm), "true"])
            after_vllm = measure(report["pid"])
        one_copy = shared.layout.nbytes
        trainer_left = after_trainer["checkpoint_rss"] + max(0, after_trainer["other_rss"] - before_trainer["other_rss"])
        vllm_released = before_vllm["other_rss"] - after_vllm["other_rss"]
        vllm_left = max(0, one_copy - vllm_released) + after_vllm["checkpoint_rss"]
        shm_once = max(after_vllm["shm_rss"], after_trainer["shm_rss"])
        mib = 2**20
        return {
            "one_copy_mib": one_copy / mib,
            "total_mib": (shm_once + trainer_left + vllm_left) / mib,
            "shm_once_mib": shm_once / mib,
            "shm_pss_sum_mib": (after_vllm["shm_pss"] + measure(me)["shm_pss"]) / mib,
            "trainer_checkpoint_before_mib": before_trainer["checkpoint_rss"] / mib,
            "trainer_left_mib": trainer_left / mib,
            "vllm_released_mib": vllm_released / mib,
            "vllm_left_mib": vllm_left / mib,
        }

    try:
        result = anyio.run(measure_both)
    finally:
        anyio.run(process.stop)
        shutil.rmtree(shm, ignore_errors=True)
    print("shared weight memory:", {k: round(v, 1) for k, v in result.items()})
    assert result["trainer_checkpoint_before_mib"] >= 0.95 * result["one_copy_mib"], "trainer weights were not resident"
    assert result["shm_once_mib"] >= 0.99 * result["one_copy_mib"], "the shared file should be resident once"
    assert result["shm_pss_sum_mib"] == pytest.approx(result["shm_once_mib"], rel=0.02)
    assert result["total_mib"] <= 1.05 * result["one_copy_mib"], result
