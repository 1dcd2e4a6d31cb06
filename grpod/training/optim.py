"""The optimizer and learning-rate schedule named by `[train]`.

- `adamw`: torch AdamW, fused (one kernel over every parameter: measured 2.5x faster than the
  per-parameter loop on a SmolLM2-sized stack of layers on one CPU thread, 6x on the tiny model);
  its moment estimates have the parameters' dtype, fp32 in grpod (full training keeps fp32
  master weights, LoRA adapters are fp32).
- `adafactor`: transformers' Adafactor with a fixed external learning rate (no relative step, no
  parameter scaling), so the schedule below means the same thing for every optimizer.
- `adamw_8bit`: bitsandbytes' 8-bit AdamW; CUDA only. Asking for it without bitsandbytes or without
  a CUDA device fails when the trainer starts, not at the first step.

Every hyperparameter of the optimizer besides the learning rate is `hyperparameters(train)`:
`train.weight_decay` and values grpod fixes (the libraries' defaults, written out so that a library
upgrade cannot change them under a resumed run). A resume applies them over the checkpoint's
(`apply_hyperparameters`), as it applies `train.lr` (`set_peak_lr`): the config is what a restart means.

Schedule (stepped once per optimizer step): linear warm-up from lr / warmup_steps to lr over
`warmup_steps`, then either constant or a cosine decay to 0 at `train.steps`.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from grpod.config import TrainConfig


class OptimizerUnavailable(RuntimeError):
    """The configured optimizer cannot run on this machine."""


# AdamW's (torch's and bitsandbytes' 8-bit one) moment decay rates and denominator epsilon.
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8


def hyperparameters(cfg: TrainConfig) -> dict[str, Any]:
    """The param-group settings of `cfg.optimizer`, the learning rate aside (the schedule's)."""
    if cfg.optimizer in ("adamw", "adamw_8bit"):
        return {"weight_decay": cfg.weight_decay, "betas": ADAMW_BETAS, "eps": ADAMW_EPS}
    if cfg.optimizer == "adafactor":
        # A fixed external learning rate (no relative step, no parameter scaling); transformers'
        # defaults for the rest.
        return {
            "weight_decay": cfg.weight_decay, "eps": (1e-30, 1e-3), "clip_threshold": 1.0, "decay_rate": -0.8,
            "beta1": None, "scale_parameter": False, "relative_step": False, "warmup_init": False,
        }
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}: use adamw, adamw_8bit or adafactor")


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: nothing for the optimizer to update")
    settings = hyperparameters(cfg)
    if cfg.optimizer == "adamw":
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
        return torch.optim.AdamW(params, lr=cfg.lr, fused=fused, **settings)
    if cfg.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=cfg.lr, **settings)
    if cfg.optimizer == "adamw_8bit":
        if importlib.util.find_spec("bitsandbytes") is None:
            raise OptimizerUnavailable(
                "train.optimizer = 'adamw_8bit' needs the bitsandbytes package, which is not installed: "
                "pip install bitsandbytes (CUDA machines only), or use 'adamw' or 'adafactor'"
            )
        if not str(cfg.device).startswith("cuda") or not torch.cuda.is_available():
            raise OptimizerUnavailable(
                f"train.optimizer = 'adamw_8bit' runs on CUDA only, but train.device = {cfg.device!r} "
                f"(CUDA available: {torch.cuda.is_available()}); use 'adamw' or 'adafactor' here"
            )
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=cfg.lr, **settings)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}: use adamw, adamw_8bit or adafactor")


def _plain(value: Any) -> Any:
    """A setting as compared: a list (as a state dict may hand a tuple back) as a tuple."""
    return tuple(value) if isinstance(value, list) else value


def apply_hyperparameters(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> list[tuple[str, Any, Any]]:
    """Put `hyperparameters(cfg)` into every param group of `optimizer` (one whose state came from
    a checkpoint holds the checkpoint's); (key, old, new) of each that changed."""
    changed: dict[str, tuple[Any, Any]] = {}
    for group in optimizer.param_groups:
        for key, value in hyperparameters(cfg).items():
            old = _plain(group.get(key))
            if old != value:
                group[key] = value
                changed.setdefault(key, (old, value))
    return [(key, old, new) for key, (old, new) in changed.items()]


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """The multiplier of `train.lr` for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg))


def follow_schedule(optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> None:
    """Each param group's learning rate set to the schedule's at its step (a schedule loaded from a
    checkpoint over an optimizer that was not: the optimizer would start at step 0's rate)."""
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = base
        group["lr"] = base * factor(scheduler.last_epoch)


def set_peak_lr(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, lr: float) -> None:
    """Make `lr` the schedule's peak from now on: the current rate and every base rate scaled by
    `lr` over the old peak, so warm-up and cosine keep their shape."""
    scale = lr / scheduler.base_lrs[0]
    scheduler.base_lrs = [base * scale for base in scheduler.base_lrs]
    for group in optimizer.param_groups:
        group["lr"] *= scale
        group["initial_lr"] = group.get("initial_lr", lr) * scale
