"""Model and optimizer state as a DCP (torch.distributed.checkpoint) checkpoint: each trainer rank
writes its shards; any world size reads them back (DCP reshards), a single process included.

Its own room because both sides use it: the trainer ranks under torchrun write and read it
(`grpod.training.distributed`), and a single-process trainer resumes from it
(`Trainer.load_sharded`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)


def save_sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Model and optimizer, each rank its shards, as a DCP checkpoint at `path` (collective)."""
    import torch.distributed.checkpoint as dcp

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(path))


def load_sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, path: Path) -> None:
    """Load what `save_sharded_state` wrote, at any world size (DCP reshards), one process
    without a process group included; the model only when `optimizer` is None (one of another
    kind starts afresh)."""
    import torch.distributed.checkpoint as dcp

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
    with warnings.catch_warnings():  # one process: DCP warns that it reads every shard itself
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def by_parameter_name(model: torch.nn.Module, optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """A single process's `optimizer.state_dict()` (parameters numbered in the order of the
    model's trainable parameters) keyed by parameter name, as DCP's state-dict API takes it."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    groups = []
    for group in optimizer_state["param_groups"]:
        groups.append({**group, "params": [names[i] for i in group["params"]]})
    state = {names[i]: value for i, value in optimizer_state["state"].items()}
    return {"state": state, "param_groups": groups}
