"""Weight-bridge modes: how the engines' weights follow the trainer's. One module per mode."""

from __future__ import annotations

import importlib

BRIDGES = {
    "none": ("grpod.bridges.none", "NoneBridge"),
    "lora_only": ("grpod.bridges.lora_only", "LoraOnlyBridge"),
    "lora_restart": ("grpod.bridges.lora_restart", "LoraRestartBridge"),
    "shared": ("grpod.bridges.shared", "SharedBridge"),
    "broadcast": ("grpod.bridges.broadcast", "BroadcastBridge"),
}


def bridge_class(mode: str) -> type:
    """The bridge class of `mode` (its module is imported only when asked for)."""
    module, name = BRIDGES[mode]
    return getattr(importlib.import_module(module), name)
