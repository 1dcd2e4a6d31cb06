"""vLLM's half of bridge mode `shared` (grpod/weights/shared_ext.py) without a server: the CPU
gemm switch, and `attach_model` on a module shaped like vLLM's (one parameter per layout slot).
The same against a real vLLM worker is in tests/e2e/test_shared_bridge.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grpod.models.tiny import build_model
from grpod.weights import shared_ext as worker_ext
from grpod.weights.shared_layout import SharedLayoutError, share_parameters


def vllm_shaped(layout, flat: torch.Tensor) -> torch.nn.Module:
    """A module with vLLM's parameter names and shapes, holding its own copy of the values."""
    root = torch.nn.Module()
    for slot in layout.slots:
        *path, leaf = slot.name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(slot.view(flat).clone(), requires_grad=False))
    return root


@pytest.fixture
def trainer_side(tmp_path):
    model, _ = build_model(seed=0, tie_word_embeddings=True)
    shared = share_parameters(model, tmp_path / "shm")
    return model, shared


def test_import_switches_cpu_linear_dispatch_to_f_linear_keeping_the_weight():
    import vllm.model_executor.layers.utils as layer_utils

    dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    assert dispatch is not dispatch.stock
    layer = torch.nn.Linear(128, 256)
    dispatch(layer, remove_weight=True)
    assert layer.cpu_linear is F.linear
    assert layer.weight.shape == (256, 128)

    # What the switch prevents: vLLM's own dispatch hands the weight to a kernel and drops it.
    stock_layer = torch.nn.Linear(128, 256)
    dispatch.stock(stock_layer, remove_weight=True)
    assert stock_layer.weight.numel() == 0


def test_attach_points_every_parameter_at_the_trainer_buffer(trainer_side, tmp_path):
    model, shared = trainer_side
    served = vllm_shaped(shared.layout, shared.flat)
    info = worker_ext.attach_model(served, tmp_path / "shm", verify_values=True)
    assert info["parameters"] == len(shared.layout.slots)
    assert worker_ext.shared_report(served)["outside"] == []
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(2.0)
        model.lm_head.weight[7].fill_(1.5)
    gate_up = served.get_parameter("model.layers.1.mlp.gate_up_proj.weight")
    assert torch.equal(gate_up[384:], model.model.layers[1].mlp.up_proj.weight)
    assert torch.all(served.model.embed_tokens.weight[7] == 1.5)


def test_a_vllm_parameter_without_a_slot_is_an_error_naming_it(trainer_side, tmp_path):
    _, shared = trainer_side
    served = vllm_shaped(shared.layout, shared.flat)
    served.get_submodule("model.layers.0").register_parameter("extra_scale", torch.nn.Parameter(torch.ones(4)))
    with pytest.raises(SharedLayoutError, match=r"model\.layers\.0\.extra_scale"):
        worker_ext.attach_model(served, tmp_path / "shm", verify_values=False)


def test_a_slot_vllm_does_not_have_is_an_error_naming_it(trainer_side, tmp_path):
    _, shared = trainer_side
    served = vllm_shaped(shared.layout, shared.flat)
    del served.model.norm._parameters["weight"]
    with pytest.raises(SharedLayoutError, match=r"model\.norm\.weight"):
        worker_ext.attach_model(served, tmp_path / "shm", verify_values=False)


def test_a_shape_mismatch_is_an_error_naming_the_parameter(trainer_side, tmp_path):
    _, shared = trainer_side
    served = vllm_shaped(shared.layout, shared.flat)
    served.get_submodule("model.layers.0.self_attn.o_proj").weight = torch.nn.Parameter(torch.zeros(128, 64))
    with pytest.raises(SharedLayoutError, match=r"o_proj\.weight is \(128, 64\)"):
        worker_ext.attach_model(served, tmp_path / "shm", verify_values=False)


def test_differing_values_are_caught_when_verified(trainer_side, tmp_path):
    _, shared = trainer_side
    served = vllm_shaped(shared.layout, shared.flat)
    with torch.no_grad():
        served.get_parameter("model.layers.1.self_attn.qkv_proj.bias")[200] += 0.125
    with pytest.raises(SharedLayoutError, match=r"qkv_proj\.bias differs .* 0\.125"):
        worker_ext.attach_model(served, tmp_path / "shm", verify_values=True)
    worker_ext.attach_model(served, tmp_path / "shm", verify_values=False)  # a relaunch after training


def test_a_layer_computing_from_a_packed_copy_is_refused(trainer_side, tmp_path):
    _, shared = trainer_side
    served = vllm_shaped(shared.layout, shared.flat)
    served.get_submodule("model.layers.0.mlp.down_proj").cpu_linear = lambda x, weight, bias: x
    with pytest.raises(SharedLayoutError, match=r"model\.layers\.0\.mlp\.down_proj computes with"):
        worker_ext.attach_model(served, tmp_path / "shm", verify_values=False)
