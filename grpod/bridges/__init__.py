"""Weight-bridge modes: how vLLM's weights follow the trainer's. One module per mode."""

from __future__ import annotations

from pathlib import Path

from grpod.config import GrpodConfig


def make_bridge(cfg: GrpodConfig, run_dir: Path, trainer, *, policy_version: int = 0):
    if cfg.bridge.mode == "none":
        from grpod.bridges.none import NoneBridge

        return NoneBridge(cfg, run_dir, trainer, policy_version=policy_version)
    if cfg.bridge.mode == "lora_only":
        from grpod.bridges.lora_only import LoraOnlyBridge

        return LoraOnlyBridge(cfg, run_dir, trainer, policy_version=policy_version)
    if cfg.bridge.mode == "lora_restart":
        from grpod.bridges.lora_restart import LoraRestartBridge

        return LoraRestartBridge(cfg, run_dir, trainer, policy_version=policy_version)
    raise NotImplementedError(f"bridge.mode = {cfg.bridge.mode!r} is not available in this build")
