"""Every weight-bridge mode on a real pretrained model: SmolLM2-135M-Instruct (Llama family: GQA
9/3 heads, tied embeddings, a 49,152-token BPE vocabulary, a chat template), served by the real
vLLM CPU build (issue #12 item 2).

Each mode: start (vLLM launched on the model, the start probe passing), one real optimizer step on
groups vLLM generated for the builtin task's instruct prompt, a sync whose probe passes, and then
vLLM's logprobs of a fixed chat sequence equal the trainer's new ones (fp32 probe bound) and have
moved from what vLLM served before the step — generation after the sync comes from the new
weights. `none` is run in place and then with `reload = "restart"` on the same bridge. The shared
layout must get the tied embedding/lm_head right (one tensor both sides), LoRA the seven Llama
projections (vLLM packs q/k/v and gate/up; the adapter names them apart).
"""

from __future__ import annotations

import pytest

from grpod.config import GrpodConfig
from grpod.daemon.step_loop import train_batch
from grpod.inference.release import group_members
from grpod.training.trainer import build_trainer
from tests.e2e.conftest import bridge_for, source_for

pytestmark = pytest.mark.e2e

# The fp32 probe bound (ProbeTolerance.for_serving): vLLM and the trainer on the same weights.
SAME = 0.02
# How far one step must have moved vLLM's logprobs for "it serves the new weights" to mean anything.
MOVED = 0.05


def config(root, model_dir, mode: str, *, lr: float, lora: bool) -> GrpodConfig:
    return GrpodConfig.model_validate(
        {
            "run": {"dir": str(root / "run")},
            "model": {"path": str(model_dir), "init_if_missing": False, "max_seq_len": 256},
            "inference": {"start_timeout_s": 600.0, "request_timeout_s": 120.0},
            "train": {
                "lr": lr,
                "threads": 2,
                "lora": lora,
                "lora_config": {"rank": 8},
                "advantages": {"drop_zero_variance": False},
            },
            "bridge": {"mode": mode, **({"reload": "in_place"} if mode == "none" else {}),
                       **({"keep_adapters": 2} if lora else {})},
            "source": {"group_size": 4, "max_tokens": 24, "task_prompt": "instruct"},
        }
    )


def chat_sequence(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 17 + 25? Answer with the number only."},
         {"role": "assistant", "content": "17 + 25 = 42."}],
        tokenize=True, return_dict=False,
    )
    return list(ids)


async def served(bridge, ids: list[int]) -> list[float]:
    return await bridge.engines[0].client.score(ids, model=bridge.policy.served_name)


def max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def rollout_groups(source, count: int):
    groups = []
    for _ in range(count):
        group = await source.generate_group()
        assert group is not None, f"generation through the bridge failed: {source.stats.drop_reasons}"
        group.scores = [float(k) for k in range(group.size)]  # a spread of rewards: every group teaches
        groups.append(group)
    return groups


def step_and_sync(portal, bridge, trainer, source, ids) -> dict:
    """One optimizer step on vLLM's own rollouts, then a sync; what vLLM serves before and after."""
    before = portal.call(served, bridge, ids)
    assert max_diff(before, trainer.score(ids)) <= SAME, "vLLM and the trainer differ before the step"
    groups = portal.call(rollout_groups, source, 2)
    metrics, fenced = portal.call(train_batch, trainer, bridge, groups)  # `shared`: the update is a sync
    assert metrics["skipped"] == 0.0 and metrics["tokens"] > 0
    record = portal.call(bridge.sync_now)
    assert record.probe is not None and record.probe["ok"], record.probe
    after = portal.call(served, bridge, ids)
    own = trainer.score(ids)
    assert max_diff(after, own) <= SAME, f"vLLM does not serve the trained weights: {max_diff(after, own):.4f}"
    assert max_diff(after, before) >= MOVED, f"the step moved vLLM's logprobs by only {max_diff(after, before):.4f}"
    return {"record": record, "moved": max_diff(after, before), "gap": max_diff(after, own)}


def run_mode(portal, tmp_path, model_dir, mode: str, *, lr: float, lora: bool, then=None):
    cfg = config(tmp_path, model_dir, mode, lr=lr, lora=lora)
    trainer = build_trainer(cfg)
    bridge = bridge_for(cfg, tmp_path / "run", trainer)
    source = source_for(cfg, trainer.tokenizer, bridge)
    assert source.task.prompt_style == "instruct"
    ids = chat_sequence(trainer.tokenizer)
    try:
        probe = portal.call(bridge.start)
        assert probe.ok, probe
        first = step_and_sync(portal, bridge, trainer, source, ids)
        # One sync (in `shared` the step itself was one more: its fence bumps the version).
        assert bridge.policy_version == (2 if bridge.mode == "shared" else 1)
        extra = then(bridge, trainer, source, ids) if then is not None else None
        return bridge, trainer, first, extra
    finally:
        portal.call(bridge.stop)


@pytest.mark.timeout(900)
def test_none_in_place_then_restart_on_smollm2(portal, tmp_path, smollm2_dir):
    def restart(bridge, trainer, source, ids):
        process = bridge.engines[0].process
        old = process.pid
        bridge.cfg.reload = "restart"
        second = step_and_sync(portal, bridge, trainer, source, ids)
        assert second["record"].phases["launch"] > 0 and process.pid != old
        assert group_members(old) == [], "the previous vLLM's process group is gone"
        return second

    bridge, _, first, second = run_mode(portal, tmp_path, smollm2_dir, "none", lr=1e-4, lora=False, then=restart)
    assert "reload" in first["record"].phases, "the first sync reloaded in place"
    assert bridge.policy_version == 2


@pytest.mark.timeout(900)
def test_shared_on_smollm2_ties_embedding_and_lm_head(portal, tmp_path, smollm2_dir):
    def tied(bridge, trainer, source, ids):
        model = trainer.model
        assert model.lm_head.weight is model.model.embed_tokens.weight, "tying survives the attach"
        assert model.lm_head.weight.shape[0] >= 49152
        return None

    run_mode(portal, tmp_path, smollm2_dir, "shared", lr=1e-4, lora=False, then=tied)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["lora_only", "lora_restart"])
def test_lora_modes_on_smollm2_adapt_all_seven_projections(portal, tmp_path, smollm2_dir, mode):
    def targets(bridge, trainer, source, ids):
        # "...self_attn.q_proj.lora_A.default.weight" -> "q_proj"
        modules = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in trainer.model.named_parameters() if ".lora_A" in name}
        assert modules == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}, modules
        return None

    run_mode(portal, tmp_path, smollm2_dir, mode, lr=2e-3, lora=True, then=targets)
