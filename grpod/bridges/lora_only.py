"""Bridge mode `lora_only`: vLLM runs the base model once and swaps adapters at runtime.

vLLM is launched once on the frozen base (`model.path`, `--enable-lora`, `--max-lora-rank` from
`train.lora_config.rank`) with the trainer's initial adapter preloaded as `policy-v0` (or
`policy-vN` when resuming at version N). Every `bridge.sync_every` steps:

    save the adapter to a NEW directory (<run>/adapters/v000007) →
    /v1/load_lora_adapter as a NEW name (policy-v7) → requests switch to it (`Policy.served_name`) →
    /v1/unload_lora_adapter of the previous name → prefix-cache reset + weight version bump →
    alignment probe on policy-v7 → prune old adapter directories to `bridge.keep_adapters`

A new name per version rather than `load_inplace` under one name: a request vLLM already admitted
keeps the adapter it resolved, so every completion is sampled by one policy version from its first
token to its last (its inference logprobs are that version's), and vLLM's prefix cache, keyed by
adapter name and path, cannot answer a new version's prompt with an old version's blocks. An
in-place load would switch admitted requests mid-generation, reuse stale cached prefixes, and
make the worker re-read that adapter from disk at every engine step that serves it (vLLM 0.32,
`vllm/lora/worker_manager.py`, `add_adapter`). The
unloaded name only leaves vLLM's registry; requests still running on it finish (vLLM reloads an
evicted adapter from its directory, which is why pruning keeps at least the previous one).

New generations wait at the availability gate from the load until the probe passed, so nothing
is sampled from an adapter the probe has not vouched for. vLLM itself never restarts on a sync;
recovery after a crash relaunches it with the current adapter preloaded.

The transition table (appended to this docstring from `TABLE` below: written once):

"""

from __future__ import annotations

from http import HTTPStatus
from pathlib import Path

from grpod.bridges.adapters import LORA_NOTES, Adapter, LoraBridge
from grpod.bridges.base import timed
from grpod.bridges.common import Event, lifecycle_notes, mode_states, mode_table
from grpod.bridges.machine import docstring_table
from grpod.inference.client import InferenceRequestError
from grpod.inference.supervised import SupervisedInference

# The lifecycle states every mode has, plus the one this mode's sync passes through.
State = mode_states("SWAPPING")


TABLE = mode_table(State, Event, "SWAPPING")

# What this mode's transitions do, beside the lifecycle's notes; the table itself is appended
# to the module docstring from TABLE (written once).
NOTES = LORA_NOTES | {("SAVING", "SAVED"): "load new name, switch requests, unload old, reset cache"}
__doc__ += docstring_table(TABLE, lifecycle_notes("SWAPPING") | NOTES)


class LoraOnlyBridge(LoraBridge):
    mode = "lora_only"
    State = State
    Event = Event
    TABLE = TABLE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Per engine, the adapter names its running vLLM may have registered (a load that timed
        # out may have).
        self._registered: dict[str, set[str]] = {}

    async def _after_launch(self, engine: SupervisedInference) -> None:
        assert self.adapter is not None
        self._registered[engine.name] = {self.adapter.name}
        await super()._after_launch(engine)

    async def _apply(self, engine: SupervisedInference, staged: Path, version: int, phases: dict[str, float]) -> None:
        assert engine.client is not None
        new = Adapter(version, staged)
        registered = self._registered.setdefault(engine.name, set())
        engine.close()
        with timed(phases, "load"):
            if new.name in registered:
                # A retried sync (FAILED --SYNC-->) at a version an interrupted attempt registered.
                # Unload rather than `load_inplace`: vLLM would reload an in-place adapter from disk
                # at every engine step for as long as it is served.
                await self._unload(engine, new.name)
            registered.add(new.name)
            await engine.client.load_lora_adapter(new.name, str(new.path))
            await engine.client.set_generate_model(new.name)
        with timed(phases, "unload_reset"):
            for name in sorted(registered - {new.name}):
                await self._unload(engine, name)
            await self._bump_version_and_reset_cache(engine, version)

    async def _applied(self, staged: Path, version: int) -> None:
        self.adapter = Adapter(version, staged)
        self._prune_adapters()

    async def _unload(self, engine: SupervisedInference, name: str) -> None:
        """Retire `name` from the engine's registry; a name vLLM never registered counts as retired."""
        assert engine.client is not None
        try:
            await engine.client.unload_lora_adapter(name)
        except InferenceRequestError as exc:
            if exc.status != HTTPStatus.NOT_FOUND:
                raise
        self._registered.get(engine.name, set()).discard(name)
