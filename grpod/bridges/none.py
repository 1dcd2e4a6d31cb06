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

Either way the sync ends with the alignment probe. Transition table:

    IDLE        --START------>  LAUNCHING
    LAUNCHING   --READY------>  PROBING
    PROBING     --PROBE_OK--->  SERVING
    PROBING     --PROBE_FAIL->  FAILED
    PROBING     --PROBE_SKIP->  SERVING       (bridge.probe_every: this sync is not probed)
    SERVING     --SYNC------->  SAVING
    SAVING      --SAVED------>  APPLYING      (reload in place, or stop + relaunch)
    APPLYING    --APPLIED---->  PROBING
    SERVING     --LOST------->  RECOVERING    (relaunch on the current weights)
    RECOVERING  --RECOVERED-->  PROBING
    APPLYING    --LOST------->  RECOVERING    (vLLM died mid-sync: relaunch on the previous weights)
    RECOVERING  --RETRY------>  APPLYING      (apply the same sync once more)
    FAILED      --SYNC------->  SAVING        (an operator's `ctl sync` retries)
    any         --FAIL------->  FAILED
    any         --STOP------->  STOPPING --STOPPED--> STOPPED
"""

from __future__ import annotations

from pathlib import Path

import anyio

from grpod.bridges.base import Bridge, timed
from grpod.bridges.common import Event, lifecycle_rows, mode_states
from grpod.inference.supervised import SupervisedInference
from grpod.weights.versions import VersionedDirs

# The lifecycle states every mode has, plus the one this mode's sync passes through.
State = mode_states("APPLYING")


TABLE = {
    **lifecycle_rows(State, Event, "APPLYING"),
    (State.SERVING, Event.SYNC): State.SAVING,
    (State.SAVING, Event.SAVED): State.APPLYING,
    (State.APPLYING, Event.APPLIED): State.PROBING,
}


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
        assert engine.client is not None
        engine.close()
        with timed(phases, "reload"):
            await engine.client.pause(mode="keep")
            # A reload that fails leaves vLLM paused: half-loaded weights are never served.
            # grpod's reload: vLLM's, then the (possibly tied) output head re-packed (reload_ext).
            await engine.client.collective_rpc("grpod_reload_weights", args=[str(staged)])
            await engine.client.end_fence(version)

    async def _applied(self, staged: Path, version: int) -> None:
        self.current_weights = staged
        protect = [e.weights for e in self.engines if e.weights is not None]
        self.versions.prune(version, KEEP_WEIGHTS, protect=protect)
