"""Bridge mode `lora_restart`: every sync relaunches vLLM on the base with the new adapter preloaded.

The restart counterpart of `lora_only`: it needs no runtime adapter API, and each vLLM process
only ever serves one adapter. Every `bridge.sync_every` steps:

    save the adapter to a NEW directory (<run>/adapters/v000007) → stop vLLM (process group) →
    wait until its processes, port and memory are released → launch it on the base model with
    `--lora-modules policy-v7=<dir>` → wait healthy → prefix-cache reset + weight version bump →
    alignment probe on policy-v7 → prune old adapter directories to `bridge.keep_adapters`

The stop and launch are the lifecycle every restarting mode shares (`Bridge._relaunch`, as `none`
with `reload = "restart"`); only the launch arguments differ. Requests wait at the availability
gate while vLLM is down; requests in flight when it stops fail and their groups are dropped.
Recovery after a crash relaunches the same way with the current adapter.

The transition table (appended to this docstring from `TABLE` below: written once):

"""

from __future__ import annotations

from pathlib import Path

from grpod.bridges.adapters import LORA_NOTES, Adapter, LoraBridge
from grpod.bridges.common import Event, lifecycle_notes, mode_states, mode_table
from grpod.bridges.machine import docstring_table
from grpod.inference.supervised import SupervisedInference

# The lifecycle states every mode has, plus the one this mode's sync passes through.
State = mode_states("RESTARTING")


TABLE = mode_table(State, Event, "RESTARTING")

# What this mode's transitions do, beside the lifecycle's notes; the table itself is appended
# to the module docstring from TABLE (written once).
NOTES = LORA_NOTES | {("SAVING", "SAVED"): "stop, wait released, launch with the new adapter"}
__doc__ += docstring_table(TABLE, lifecycle_notes("RESTARTING") | NOTES)


class LoraRestartBridge(LoraBridge):
    mode = "lora_restart"
    State = State
    Event = Event
    TABLE = TABLE

    async def _apply(self, engine: SupervisedInference, staged: Path, version: int, phases: dict[str, float]) -> None:
        # The adapter to preload is part of the launch arguments (`_launch_kwargs`); from here
        # on it is the one vLLM is asked to serve, also by a retry or a recovery.
        self.adapter = Adapter(version, staged)
        await self._relaunch(engine, self.current_weights, phases)
        await self._bump_version_and_reset_cache(engine, version)

    async def _applied(self, staged: Path, version: int) -> None:
        self._prune_adapters()
