"""Weight-bridge modes: how vLLM's weights follow the trainer's. One module per mode."""

from __future__ import annotations

import importlib
from pathlib import Path

from grpod.config import GrpodConfig

BRIDGES = {
    "none": ("grpod.bridges.none", "NoneBridge"),
    "lora_only": ("grpod.bridges.lora_only", "LoraOnlyBridge"),
    "lora_restart": ("grpod.bridges.lora_restart", "LoraRestartBridge"),
    "shared": ("grpod.bridges.shared", "SharedBridge"),
}


def make_bridge(cfg: GrpodConfig, run_dir: Path, trainer, *, policy_version: int = 0):
    module, name = BRIDGES[cfg.bridge.mode]
    bridge_class = getattr(importlib.import_module(module), name)
    return bridge_class(cfg, run_dir, trainer, policy_version=policy_version)
