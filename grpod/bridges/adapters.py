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

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog

from grpod.bridges.base import Bridge

log = structlog.get_logger(__name__)

# The only values vLLM accepts for --max-lora-rank (vllm.config.lora.MaxLoRARanks).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MIN_KEPT_ADAPTERS = 2
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
_PARTIAL_PREFIX = ".partial-"


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


class AdapterStore:
    """The versioned adapter directories of one run (`<run>/adapters`)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path_for(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def versions(self) -> list[int]:
        """Versions with a published directory, oldest first."""
        if not self.root.exists():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _VERSION_DIR.match(entry.name)
            if match and entry.is_dir():
                found.append(int(match.group(1)))
        return sorted(found)

    def write(self, trainer, version: int) -> Adapter:
        """Save the trainer's adapter as `version` (replacing a directory of that version left by
        a failed sync or an earlier run) and publish it by rename. Blocking: run it in a thread."""
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.path_for(version)
        partial = self.root / f"{_PARTIAL_PREFIX}{target.name}"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            trainer.save_weights(partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        if target.exists():
            shutil.rmtree(target)
        partial.rename(target)
        return Adapter(version, target)

    def prune(self, current: int, keep: int) -> list[int]:
        """Remove all but the newest `max(keep, 2)` versions up to `current`, every version after
        it, and partial writes; returns the versions removed."""
        keep = max(keep, MIN_KEPT_ADAPTERS)
        versions = self.versions()
        kept = [v for v in versions if v <= current][-keep:]
        removed = [v for v in versions if v not in kept]
        for version in removed:
            shutil.rmtree(self.path_for(version), ignore_errors=True)
        if self.root.exists():
            for entry in self.root.iterdir():
                if entry.name.startswith(_PARTIAL_PREFIX):
                    shutil.rmtree(entry, ignore_errors=True)
        if removed:
            log.info("adapters_pruned", removed=removed, kept=kept)
        return removed


class LoraBridge(Bridge):
    """The part of a LoRA mode that is not its sync: vLLM on the base model with the current
    adapter preloaded (`--lora-modules`), at start, at every relaunch and at recovery alike.

    `current_weights` stays `model.path` (what vLLM's `--model` is); `adapter` is the policy.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.adapters = AdapterStore(self.run_dir / "adapters")
        self.adapter: Adapter | None = None
        self.max_lora_rank = max_lora_rank(self.cfg.train.lora_config.rank)

    def request_model(self) -> str:
        if self.adapter is None:
            raise RuntimeError(f"bridge {self.mode}: no adapter is served before start()")
        return self.adapter.name

    def _launch_kwargs(self) -> dict[str, Any]:
        if self.adapter is None:
            raise RuntimeError(f"bridge {self.mode}: launching vLLM before an adapter was written")
        return {
            "enable_lora": True,
            "max_lora_rank": self.max_lora_rank,
            "lora_target_modules": list(self.cfg.train.lora_config.target_modules),
            "lora_modules": {self.adapter.name: str(self.adapter.path)},
        }

    async def _write_adapter(self, version: int) -> Adapter:
        return await anyio.to_thread.run_sync(self.adapters.write, self.trainer, version)

    async def _initial_weights(self, resumed: bool) -> Path:
        """The trainer's adapter as it is now (fresh or resumed) becomes the served one; vLLM's
        model is the base either way."""
        self.adapter = await self._write_adapter(self.policy_version)
        self.adapters.prune(self.policy_version, self.cfg.bridge.keep_adapters)
        return self.cfg.model.path

    async def _save(self, version: int) -> Path:
        return (await self._write_adapter(version)).path

    def _prune_adapters(self) -> None:
        assert self.adapter is not None
        self.adapters.prune(self.adapter.version, self.cfg.bridge.keep_adapters)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "adapter": self.adapter.as_dict() if self.adapter else None}
