"""Bridge mode `none`: vLLM holds its own full copy; a sync ships a full HF checkpoint.

Every `bridge.sync_every` steps the trainer saves its weights as an HF safetensors checkpoint in
a new versioned directory (`<run>/weights/v000007`), then either

- `reload = "in_place"` (default, the fast path): fence vLLM (`/grpod/pause?mode=keep`), reload
  the weights in place with `collective_rpc("grpod_reload_weights", path)` (vLLM's
  `reload_weights`, then the output head re-packed: `grpod.inference.reload_ext`), then reset the
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

import time
from pathlib import Path

from grpod.bridges.base import Bridge
from grpod.bridges.common import Event, lifecycle_rows, mode_states


# The lifecycle states every mode has, plus the one this mode's sync passes through.
State = mode_states("APPLYING")


TABLE = {
    **lifecycle_rows(State, Event, "APPLYING"),
    (State.SERVING, Event.SYNC): State.SAVING,
    (State.SAVING, Event.SAVED): State.APPLYING,
    (State.APPLYING, Event.APPLIED): State.PROBING,
}


RELOAD_EXTENSION = "grpod.inference.reload_ext.ReloadExtension"


class NoneBridge(Bridge):
    mode = "none"
    State = State
    Event = Event
    TABLE = TABLE

    def _launch_kwargs(self) -> dict:
        return {"worker_extension": RELOAD_EXTENSION}

    async def _save(self, version: int) -> Path:
        return await self._write_weights(self.weights_root / f"v{version:06d}")

    async def _apply(self, staged: Path, version: int, phases: dict[str, float]) -> None:
        if self.cfg.bridge.reload == "restart":
            await self._relaunch(staged, phases)
            self.current_weights = staged
            await self._bump_version_and_reset_cache(version)
        else:
            assert self.client is not None
            self._close()
            t = time.perf_counter()
            await self.client.pause(mode="keep")
            # A reload that fails leaves vLLM paused: half-loaded weights are never served.
            # grpod's reload: vLLM's, then the (possibly tied) output head re-packed (reload_ext).
            await self.client.collective_rpc("grpod_reload_weights", args=[str(staged)])
            await self.client.end_fence(version)
            phases["reload"] = time.perf_counter() - t
            self.current_weights = staged
        self._prune_weights(keep=2)
