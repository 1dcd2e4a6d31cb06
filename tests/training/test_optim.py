import importlib.util
import math

import pytest
import torch

from grpod.config import TrainConfig
from grpod.training.optim import (
    ADAMW_BETAS,
    ADAMW_EPS,
    OptimizerUnavailable,
    apply_hyperparameters,
    build_optimizer,
    build_scheduler,
    follow_schedule,
    hyperparameters,
    lr_factor,
)


def test_warmup_is_linear_then_constant():
    cfg = TrainConfig(warmup_steps=4, schedule="constant", steps=10)
    assert [lr_factor(s, cfg) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_decays_from_one_to_zero_after_warmup():
    cfg = TrainConfig(warmup_steps=2, schedule="cosine", steps=12)
    assert lr_factor(1, cfg) == 1.0
    assert lr_factor(2, cfg) == 1.0
    assert lr_factor(7, cfg) == pytest.approx(0.5)
    assert lr_factor(12, cfg) == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(50, cfg) == pytest.approx(0.0, abs=1e-12)
    values = [lr_factor(s, cfg) for s in range(2, 13)]
    assert values == sorted(values, reverse=True)


def test_scheduler_applies_the_factor_to_the_optimizer():
    cfg = TrainConfig(lr=1e-3, warmup_steps=2, schedule="cosine", steps=4)
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = build_optimizer([param], cfg)
    scheduler = build_scheduler(optimizer, cfg)
    lrs = []
    for _ in range(4):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3 * 0.5 * (1 + math.cos(math.pi / 2))])


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_optimizers_keep_fp32_state_for_fp32_parameters(name):
    param = torch.nn.Parameter(torch.ones(4, 4))
    optimizer = build_optimizer([param], TrainConfig(optimizer=name, lr=1e-2))
    param.grad = torch.ones(4, 4)
    optimizer.step()
    assert param.data.lt(1).all()
    states = [v for v in optimizer.state[param].values() if isinstance(v, torch.Tensor) and v.numel() > 1]
    assert states and all(v.dtype == torch.float32 for v in states)


def test_frozen_parameters_are_not_optimized_and_none_trainable_is_an_error():
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([frozen], TrainConfig())


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed here")
def test_adamw_8bit_names_the_missing_package():
    with pytest.raises(OptimizerUnavailable, match="needs the bitsandbytes package"):
        build_optimizer([torch.nn.Parameter(torch.ones(2))], TrainConfig(optimizer="adamw_8bit"))


def test_adamw_8bit_refuses_a_cpu_device(monkeypatch):
    # bitsandbytes may be absent here; pretend it is present to reach the device check.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "bitsandbytes" else real(n, *a))
    with pytest.raises(OptimizerUnavailable, match="runs on CUDA only, but train.device = 'cpu'"):
        build_optimizer([torch.nn.Parameter(torch.ones(2))], TrainConfig(optimizer="adamw_8bit", device="cpu"))


@pytest.mark.parametrize("name", ["adamw", "adafactor"])
def test_the_optimizer_is_built_with_its_hyperparameters(name):
    cfg = TrainConfig(optimizer=name, weight_decay=0.05)
    group = build_optimizer([torch.nn.Parameter(torch.ones(2))], cfg).param_groups[0]
    assert {key: group[key] for key in hyperparameters(cfg)} == hyperparameters(cfg)
    assert group["weight_decay"] == 0.05


def test_a_checkpoints_optimizer_settings_give_way_to_the_configs_and_each_change_is_reported():
    """What a resume does after loading the checkpoint's param groups (`Trainer.load_state_dict`)."""
    cfg = TrainConfig(weight_decay=0.1)
    params = [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]
    saved = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=1e-3, weight_decay=0.0,
                              betas=[0.8, 0.99], eps=ADAMW_EPS)
    changed = apply_hyperparameters(saved, cfg)
    assert sorted(changed) == [("betas", (0.8, 0.99), ADAMW_BETAS), ("weight_decay", 0.0, 0.1)], "once each, not per group"
    assert all(g["weight_decay"] == 0.1 and g["betas"] == ADAMW_BETAS for g in saved.param_groups)
    assert apply_hyperparameters(saved, cfg) == []


def test_an_optimizer_under_a_loaded_schedule_follows_it():
    cfg = TrainConfig(lr=1e-3, warmup_steps=4)
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = build_optimizer([param], cfg)
    scheduler = build_scheduler(optimizer, cfg)
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    fresh = build_optimizer([param], cfg)
    resumed = build_scheduler(fresh, cfg)
    resumed.load_state_dict(scheduler.state_dict())
    assert fresh.param_groups[0]["lr"] == pytest.approx(2.5e-4), "a fresh optimizer is at step 0's rate"
    follow_schedule(fresh, resumed)
    assert fresh.param_groups[0]["lr"] == pytest.approx(7.5e-4) == optimizer.param_groups[0]["lr"]
