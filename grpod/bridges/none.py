"""Bridge mode `none`: vLLM holds its own full copy; a sync ships a full HF checkpoint.

Every `bridge.sync_every` steps the trainer saves its weights as an HF safetensors checkpoint in
a new versioned directory (`<run>/weights/v000007`), then either

- `reload = "in_place"` (default, the fast path): fence vLLM (`/grpod/pause?mode=keep`), reload
  the weights in place with `collective_rpc("grpod_reload_weights", path)` (vLLM's
  `reload_weights`, then the output head re-packed: `grpod.weights.reload_ext`), then reset the
  prefix cache, bump the weight version and resume in one request (`/grpod/resume`) — no
  restart; a reload that fails leaves vLLM paused (it never serves half-loaded weights); or
- `reload = "restart"`: stop vLLM (process group), wait until its processes, port and memory are
  gone, relaunch it on the new directory, wait until healthy.

Either way the sync ends with the alignment probe.

The transition table (appended to this docstring from `TABLE` below: written once):

"""

from __future__ import annotations

from pathlib import Path

import anyio

from grpod.bridges.base import Bridge, timed
from grpod.bridges.common import Event, lifecycle_notes, mode_states, mode_table
from grpod.bridges.machine import docstring_table
from grpod.inference.supervised import SupervisedInference
from grpod.weights.versions import VersionedDirs

# The lifecycle states every mode has, plus the one this mode's sync passes through.
State = mode_states("APPLYING")


TABLE = mode_table(State, Event, "APPLYING")

# What this mode's transitions do, beside the lifecycle's notes; the table itself is appended
# to the module docstring from TABLE (written once).
NOTES = {("SAVING", "SAVED"): "reload in place, or stop + relaunch",
         ("SERVING", "LOST"): "relaunch on the current weights"}
__doc__ += docstring_table(TABLE, lifecycle_notes("APPLYING") | NOTES)


RELOAD_EXTENSION = "grpod.weights.reload_ext.ReloadExtension"
# Full-weight versions kept on disk: the one served and the one before (a relaunch mid-sync).
KEEP_WEIGHTS = 2


class NoneBridge(Bridge):
    mode = "none"
    State = State
    Event = Event
    TABLE = TABLE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.versions = VersionedDirs(self.run_dir / "weights")

    def _launch_kwargs(self) -> dict:
        return {"worker_extension": RELOAD_EXTENSION}

    async def _initial_weights(self, resumed_weights: Path | None) -> Path:
        """Resuming: the checkpoint's weights, published (hard-linked) as the current version,
        so a relaunch still finds them once the checkpoint is pruned."""
        if resumed_weights is None:
            return self.model.path
        return await anyio.to_thread.run_sync(self.versions.adopt, self.policy.version, resumed_weights)

    async def _save(self, version: int) -> Path:
        return await anyio.to_thread.run_sync(self.versions.write, version, self.trainer.save_weights)

    async def _apply(self, engine: SupervisedInference, staged: Path, version: int, phases: dict[str, float]) -> None:
        if self.cfg.reload == "restart":
            await self._relaunch(engine, staged, phases)
            await self._bump_version_and_reset_cache(engine, version)
            return
        with timed(phases, "reload"):
            await engine.pause()
            assert engine.client is not None
            # A reload that fails leaves vLLM paused: half-loaded weights are never served.
            # grpod's reload: vLLM's, then the (possibly tied) output head re-packed (reload_ext).
            await engine.client.collective_rpc("grpod_reload_weights", args=[str(staged)])
            await engine.client.end_fence(version)

    async def _applied(self, staged: Path, version: int) -> None:
        self.current_weights = staged
        self.versions.prune(version, KEEP_WEIGHTS, protect=self.in_use(self.engines))
