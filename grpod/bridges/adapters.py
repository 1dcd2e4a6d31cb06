"""What both LoRA bridge modes share: versioned adapter directories and the base-model launch.

In the LoRA modes vLLM always runs the frozen base model (`model.path`, which is also the bridge's
`current_weights`); the policy is the adapter it serves on top. Every policy version gets its own
adapter directory (`<run>/adapters/v000007`) and its own adapter name (`policy-v7`), never an
overwrite of the previous ones, because vLLM keys its prefix cache (and its adapter cache) by
name and path: a new name and path per version can never be answered from blocks computed with
an older adapter. The prefix cache is still reset after every change (the invariant every mode
keeps), so this holds even when a retried sync reuses a version's name.

Guarantees:
- an adapter directory is complete or absent: it is written under a hidden temporary name and
  renamed into place once `trainer.save_weights` returned;
- pruning keeps the newest `bridge.keep_adapters` versions, and never fewer than two: vLLM may
  still be finishing requests on the previous adapter and reloads an adapter it evicted from its
  directory, so the previous directory must outlive the switch. Directories of versions newer
  than the current one (left by an earlier run that got further than the checkpoint it resumed
  from) are removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog

from grpod.bridges.base import Bridge
from grpod.inference.supervised import SupervisedInference
from grpod.weights.versions import VersionedDirs

log = structlog.get_logger(__name__)

# The only values vLLM accepts for --max-lora-rank (vllm.config.lora.MaxLoRARanks).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# What both LoRA modes' transitions do (their docstring tables' notes); each adds how it applies.
LORA_NOTES = {("IDLE", "START"): "write the initial adapter, launch with it preloaded",
              ("SERVING", "SYNC"): "adapter → new versioned directory",
              ("SERVING", "LOST"): "relaunch on the base with the current adapter"}


class LoraRankUnsupported(ValueError):
    """The adapter rank is larger than any rank vLLM can serve."""


def max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that can serve adapters of `rank`."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise LoraRankUnsupported(
        f"train.lora_config.rank = {rank} exceeds vLLM's largest --max-lora-rank "
        f"({VLLM_MAX_LORA_RANKS[-1]}); lower train.lora_config.rank"
    )


@dataclass(frozen=True)
class Adapter:
    """One policy version's adapter: its directory and the name vLLM serves it under."""

    version: int
    path: Path

    @property
    def name(self) -> str:
        return adapter_name(self.version)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "path": str(self.path)}


def adapter_name(version: int) -> str:
    return f"policy-v{version}"


class LoraBridge(Bridge):
    """The part of a LoRA mode that is not its sync: vLLM on the base model with the current
    adapter preloaded (`--lora-modules`), at start, at every relaunch and at recovery alike, and
    `/generate` (what Atropos environments call, naming no model) pointed at that adapter.

    `current_weights` stays `model.path` (what vLLM's `--model` is); `adapter` is the policy.
    """

    def __init__(self, *args, lora, **kwargs) -> None:
        """`lora`: the trainer's `train.lora_config` (rank and target modules vLLM must serve)."""
        super().__init__(*args, **kwargs)
        self.lora = lora
        self.adapters = VersionedDirs(self.run_dir / "adapters")
        self.adapter: Adapter | None = None
        self.max_lora_rank = max_lora_rank(lora.rank)

    def _served_name(self) -> str | None:
        if self.adapter is None:
            raise RuntimeError(f"bridge {self.mode}: no adapter is served before start()")
        return self.adapter.name

    def _launch_kwargs(self) -> dict[str, Any]:
        if self.adapter is None:
            raise RuntimeError(f"bridge {self.mode}: launching vLLM before an adapter was written")
        return {
            "enable_lora": True,
            "max_lora_rank": self.max_lora_rank,
            "lora_target_modules": list(self.lora.target_modules),
            "lora_modules": {self.adapter.name: str(self.adapter.path)},
        }

    async def _after_launch(self, engine: SupervisedInference) -> None:
        await self._serve_on_generate(engine)

    async def _serve_on_generate(self, engine: SupervisedInference) -> None:
        """`/generate` requests that name no model sample the current adapter."""
        assert engine.client is not None and self.adapter is not None
        await engine.client.set_generate_model(self.adapter.name)

    async def _write_adapter(self, version: int) -> Adapter:
        path = await anyio.to_thread.run_sync(self.adapters.write, version, self.trainer.save_weights)
        return Adapter(version, path)

    async def _initial_weights(self, resumed_weights: Path | None) -> Path:
        """The trainer's adapter as it is now (fresh or resumed) becomes the served one; vLLM's
        model is the base either way."""
        if resumed_weights is not None:
            path = await anyio.to_thread.run_sync(self.adapters.adopt, self.policy.version, resumed_weights)
            self.adapter = Adapter(self.policy.version, path)
        else:
            await self._loaded_trainer()  # a fresh run's first adapter is the trainer's
            self.adapter = await self._write_adapter(self.policy.version)
        self.policy.publish(self.policy.version, self.adapter.name)
        self._prune_adapters()
        return self.model.path

    async def _save(self, version: int) -> Path:
        return (await self._write_adapter(version)).path

    def _current_copy(self):
        assert self.adapter is not None
        return self.adapter.path

    def _prune_adapters(self) -> None:
        assert self.adapter is not None
        self.adapters.prune(self.adapter.version, self.cfg.keep_adapters, protect=self.in_use(self.engines))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "adapter": self.adapter.as_dict() if self.adapter else None}
