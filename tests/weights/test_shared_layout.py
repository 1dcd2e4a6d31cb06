"""The trainer's half of bridge mode `shared` (grpod/weights/shared_layout.py), on CPU without vLLM:
vLLM's fused layout, padded vocabulary rows, tied embeddings as one parameter, rotary buffers from
the model's own config, and writes through the parameters landing in the shared file."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpod.models.tiny import build_model, save_model
from grpod.weights.shared_layout import (
    WEIGHTS_FILE,
    SharedLayout,
    SharedLayoutError,
    plan_layout,
    share_parameters,
)

ROPE = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


def mapped_again(directory, layout: SharedLayout) -> torch.Tensor:
    """A second, independent mapping of the shared file: what another process would see."""
    return torch.from_file(str(directory / WEIGHTS_FILE), shared=True, size=layout.numel, dtype=torch.float32)


@pytest.fixture
def untied():
    model, _ = build_model(seed=0, tie_word_embeddings=False)
    return model


def test_qkv_and_gate_up_are_stacked_in_vllm_order_and_params_are_views(untied, tmp_path):
    original = copy.deepcopy(untied)
    shared = share_parameters(untied, tmp_path / "shm")
    layout = shared.layout
    slots = {s.name: s for s in layout.slots}
    qkv = slots["model.layers.1.self_attn.qkv_proj.weight"]
    assert [(p.source.rsplit(".", 2)[-2], p.row, p.rows) for p in qkv.parts] == [
        ("q_proj", 0, 128), ("k_proj", 128, 128), ("v_proj", 256, 128),
    ]  # fmt: skip
    assert qkv.shape == (384, 128)
    assert slots["model.layers.1.self_attn.qkv_proj.bias"].shape == (384,)
    gate_up = slots["model.layers.0.mlp.gate_up_proj.weight"]
    assert [p.source for p in gate_up.parts] == ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"]
    assert gate_up.shape == (768, 128)
    assert not any(name.endswith(("q_proj.weight", "gate_proj.weight")) for name in slots)

    other = mapped_again(tmp_path / "shm", layout)
    fused = qkv.view(other)
    attn = untied.model.layers[1].self_attn
    assert attn.k_proj.weight.data_ptr() == qkv.view(shared.flat)[128].data_ptr()
    assert torch.equal(fused[128:256], original.model.layers[1].self_attn.k_proj.weight)
    assert torch.equal(gate_up.view(other)[384:], original.model.layers[0].mlp.up_proj.weight)
    for name, param in untied.named_parameters():
        assert shared.holds(param), f"{name} is not inside the shared buffer"
        assert torch.equal(param, dict(original.named_parameters())[name]), f"{name} changed value when shared"

    with torch.no_grad():
        attn.v_proj.bias.fill_(0.5)
        attn.q_proj.weight[3, 7] = -2.0
    bias = slots["model.layers.1.self_attn.qkv_proj.bias"].view(other)
    assert torch.all(bias[256:] == 0.5) and not torch.any(bias[:256] == 0.5)
    assert fused[3, 7].item() == -2.0


def test_vocab_rows_are_padded_to_64_with_zeros(untied, tmp_path):
    shared = share_parameters(untied, tmp_path / "shm")
    slots = {s.name: s for s in shared.layout.slots}
    vocab = untied.config.vocab_size
    assert vocab % 64 != 0, "the tiny vocabulary should need padding for this test to mean anything"
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        slot = slots[name]
        assert slot.shape == (64, 128) and slot.parts[0].rows == vocab
        rows = slot.view(mapped_again(tmp_path / "shm", shared.layout))
        assert torch.all(rows[vocab:] == 0)
        assert torch.count_nonzero(rows[:vocab]) > 0
    assert untied.model.embed_tokens.weight.shape == (vocab, 128)
    assert untied.lm_head.weight.shape == (vocab, 128)


def test_tied_embeddings_stay_one_parameter_in_one_slot(tmp_path):
    model, _ = build_model(seed=0, tie_word_embeddings=True)
    count = len(list(model.parameters()))
    shared = share_parameters(model, tmp_path / "shm")
    names = [s.name for s in shared.layout.slots]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(list(model.parameters())) == count
    with torch.no_grad():
        model.model.embed_tokens.weight[5].fill_(3.0)
    assert torch.all(model.lm_head.weight[5] == 3.0)


def test_rotary_buffers_come_from_the_config_and_outputs_do_not_change(tmp_path):
    model, _ = build_model(seed=0, rope_scaling=ROPE)
    fresh, _ = build_model(seed=1, rope_scaling=ROPE)
    ids = torch.tensor([[3, 9, 27, 4, 11, 30, 8]])
    with torch.no_grad():
        before = model(ids).logits
    share_parameters(model, tmp_path / "shm")
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)
    assert torch.equal(model.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)
    # linear scaling by 2 halves every frequency of the unscaled model
    plain, _ = build_model(seed=0)
    assert torch.allclose(model.model.rotary_emb.inv_freq * 2, plain.model.rotary_emb.inv_freq)


def test_optimizer_steps_write_into_the_shared_file(untied, tmp_path):
    optimizer = torch.optim.AdamW(untied.parameters(), lr=1e-2)  # built before sharing, as the Trainer does
    shared = share_parameters(untied, tmp_path / "shm")
    other = mapped_again(tmp_path / "shm", shared.layout)
    before = other.clone()
    loss = untied(torch.tensor([[3, 9, 27, 4, 11]]), labels=torch.tensor([[3, 9, 27, 4, 11]])).loss
    loss.backward()
    optimizer.step()
    assert not torch.equal(before, other)
    slots = {s.name: s for s in shared.layout.slots}
    down = slots["model.layers.0.mlp.down_proj.weight"].view(other)
    assert torch.equal(down, untied.model.layers[0].mlp.down_proj.weight)
    assert torch.all(slots["lm_head.weight"].view(other)[untied.config.vocab_size :] == 0)


def test_checkpoint_of_a_shared_model_round_trips(tmp_path):
    model, tok = build_model(seed=0, tie_word_embeddings=True)
    share_parameters(model, tmp_path / "shm")
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.add_(0.25)
    save_model(model, tok, tmp_path / "saved")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    for name, param in model.named_parameters():
        assert torch.equal(param, dict(loaded.named_parameters())[name]), f"{name} did not survive save/load"


def test_layout_json_round_trips(untied, tmp_path):
    shared = share_parameters(untied, tmp_path / "shm")
    assert SharedLayout.load(tmp_path / "shm") == shared.layout
    assert shared.layout.nbytes == (tmp_path / "shm" / WEIGHTS_FILE).stat().st_size
    assert all(s.offset % 64 == 0 for s in shared.layout.slots)


class PartialAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8)
        self.v_proj = torch.nn.Linear(8, 8)


def test_a_fused_group_missing_a_shard_is_an_error_naming_it():
    model = torch.nn.Module()
    model.attn = PartialAttention()
    with pytest.raises(SharedLayoutError, match=r"attn\.qkv_proj\.weight.*no k_proj"):
        plan_layout(model)


def test_mixed_dtypes_are_an_error_naming_the_parameter(untied):
    untied.model.norm.half()
    with pytest.raises(SharedLayoutError, match=r"model\.norm\.weight"):
        plan_layout(untied)


def test_a_non_empty_directory_is_refused(untied, tmp_path):
    (tmp_path / "shm").mkdir()
    (tmp_path / "shm" / "leftover").write_text("x")
    with pytest.raises(SharedLayoutError, match="not empty"):
        share_parameters(untied, tmp_path / "shm")


def test_an_already_fused_parameter_maps_to_itself():
    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.qkv_proj = torch.nn.Linear(8, 24)
    layout = plan_layout(model)
    assert [(s.name, s.shape, [p.source for p in s.parts]) for s in layout.slots] == [
        ("attn.qkv_proj.weight", (24, 8), ["attn.qkv_proj.weight"]),
        ("attn.qkv_proj.bias", (24,), ["attn.qkv_proj.bias"]),
    ]
