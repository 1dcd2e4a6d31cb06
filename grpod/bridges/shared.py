"""Bridge mode `shared`: one copy of the weights, read by vLLM and written by the trainer.

At start the trainer's parameters move into one buffer laid out the way vLLM holds the model
(`grpod.weights.shared_layout`: qkv / gate_up fused, vocabulary padded to 64 rows, tied embeddings one
slot) — a file in a run-scoped /dev/shm directory on CPU, CUDA IPC memory on a GPU — and become
views into it. vLLM launches with grpod's worker extension (`grpod.weights.shared_ext`, which on
CPU keeps linear weights as plain tensors), loads the checkpoint as usual, then
`collective_rpc("attach_shared", dir)` re-points each of its parameters at the same memory and
frees its own copy. From then on there is nothing to ship: the optimizer step *is* the sync.

The fence: the step loop runs every optimizer update through `bridge.fence(update)`, a line of
the loop; this bridge runs its sync around the update:

    /grpod/pause?mode=keep → optimizer.step() writes the shared tensors in place →
    /grpod/resume (prefix-cache reset + weight version bump + resume, one request) → probe

so no forward pass ever reads half-written weights, and generation is paused only for the step
itself, not for the forward/backward before it. vLLM's pause clears its caches and preempts the
frozen requests, so a generation in flight resumes by recomputing its KV with the new weights.
Every optimizer update is therefore a sync and `bridge.sync_every` does not apply (`sync_due` is
never true); `fence` returns the sync it made. A skipped step (no optimizer step) makes none. `ctl sync` re-fences with nothing to write: a version bump and a
probe. If vLLM dies during the fence, it is relaunched and re-attached and the fence runs again
(the optimizer step only if it had not run yet). If the step or the version bump fails while vLLM
is alive, vLLM stays paused (it never serves torn weights) and the bridge is FAILED.

Recovery after a vLLM crash relaunches vLLM and re-attaches it to the same buffer (which holds the
trained weights: the trainer owns it). `stop` stops vLLM and removes the /dev/shm directory; the
trainer's mapping stays valid until the process exits, so a final checkpoint still works.

Requirements, checked at construction: full fine-tuning in fp32 (`model.dtype = "float32"`, the
dtype the trainer's master weights have), `inference.enforce_eager = true` (compiled graphs would
keep the addresses of vLLM's own copy), and on a GPU the trainer and vLLM on the same device
(checked by device UUID at attach).

The transition table (appended to this docstring from `TABLE` below: written once):

"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import anyio
import structlog

from grpod.bridges.base import Bridge, BridgeFailed, SyncRecord, Update
from grpod.bridges.common import Event, lifecycle_notes, mode_states, mode_table
from grpod.bridges.machine import docstring_table
from grpod.config import ModelConfig, run_key
from grpod.inference.client import InferenceRequestError
from grpod.inference.supervised import SupervisedInference
from grpod.weights.shared_layout import SharedWeights, share_parameters

log = structlog.get_logger(__name__)

WORKER_EXTENSION = "grpod.weights.shared_ext.SharedWeightsExtension"
SHM_ROOT = Path("/dev/shm")


class SharedModeUnsupported(ValueError):
    """The configuration cannot run bridge.mode = 'shared'; the message says which key to change."""


# The lifecycle states every mode has, plus the one this mode's sync passes through.
State = mode_states("FENCED")


TABLE = mode_table(State, Event, "FENCED")

# What this mode's transitions do, beside the lifecycle's notes; the table itself is appended
# to the module docstring from TABLE (written once).
NOTES = {("IDLE", "START"): "share the trainer's weights, launch vLLM, attach",
         ("SERVING", "SYNC"): "nothing to write: the buffer is the weights",
         ("SAVING", "SAVED"): "paused; optimizer step; cache reset; version bump",
         ("FENCED", "APPLIED"): "resumed", ("SERVING", "LOST"): "relaunch vLLM, re-attach to the same buffer",
         ("FENCED", "LOST"): "vLLM died mid-fence: relaunch, re-attach"}
__doc__ += docstring_table(TABLE, lifecycle_notes("FENCED") | NOTES)


def shared_dir(run_dir: Path) -> Path:
    """The run's /dev/shm directory: named after the run directory, so a restart of the same run
    finds (and replaces) what a killed predecessor left."""
    return SHM_ROOT / f"grpod-shared-{run_key(run_dir)}"


def check_supported(model: ModelConfig, enforce_eager: bool, trainer_device: str, vllm_on_gpu: bool, engines: int) -> None:
    """Refuse, before anything is launched, a configuration shared mode cannot serve (LoRA is
    refused by the config itself)."""
    if model.dtype != "float32":
        raise SharedModeUnsupported(
            f"bridge.mode = 'shared' needs model.dtype = 'float32' (the trainer's fp32 weights are what vLLM "
            f"reads), not {model.dtype!r}; set model.dtype = 'float32' or use bridge.mode = 'none'"
        )
    if not enforce_eager:
        raise SharedModeUnsupported(
            "bridge.mode = 'shared' needs inference.enforce_eager = true: compiled graphs keep the addresses "
            "of vLLM's own weight copy, which attaching replaces"
        )
    on_gpu = trainer_device.startswith("cuda")
    if on_gpu != vllm_on_gpu:
        raise SharedModeUnsupported(
            f"bridge.mode = 'shared' needs the trainer and vLLM on the same device: train.device = "
            f"{trainer_device!r} but vLLM runs on {'a GPU' if vllm_on_gpu else 'the CPU'}"
        )
    if engines != 1:
        raise SharedModeUnsupported(
            f"bridge.mode = 'shared' serves one engine from the trainer's memory, not {engines}; "
            "set inference.engines = 1 or use bridge.mode = 'none' or 'broadcast'"
        )


class SharedBridge(Bridge):
    mode = "shared"
    # The optimizer step itself runs inside the fence: there is no copy to apply later.
    pipelined = False
    State = State
    Event = Event
    TABLE = TABLE

    def __init__(self, *args, train_device: str, **kwargs) -> None:
        """`train_device`: where the trainer's parameters live (`train.device`)."""
        super().__init__(*args, **kwargs)
        first = self.engines[0]
        check_supported(self.model, first.cfg.enforce_eager, train_device, first.process.gpu, len(self.engines))
        if self.cfg.sync_every != 1:
            log.warning("shared_sync_every_ignored", sync_every=self.cfg.sync_every, reason="every optimizer step is a sync")
        self.shm_dir = shared_dir(self.run_dir)
        self.shared: SharedWeights | None = None
        self._update: Update | None = None
        # vLLM's freshly loaded values equal the trainer's only before the first optimizer step
        # of a run that did not resume; then attach also checks them, parameter by parameter.
        self._verify_values = True

    def _launch_kwargs(self) -> dict[str, Any]:
        return {"worker_extension": WORKER_EXTENSION}

    async def _initial_weights(self, resumed_weights: Path | None) -> Path:
        """vLLM loads the base checkpoint (for its shapes); attaching gives it the trainer's values."""
        self._verify_values = resumed_weights is None
        return self.model.path

    def _share_trainer_weights(self, trainer) -> SharedWeights:
        if self.shm_dir.exists():
            log.warning("shared_stale_dir_removed", directory=str(self.shm_dir))
            shutil.rmtree(self.shm_dir)
        return share_parameters(trainer.model, self.shm_dir)

    async def _after_launch(self, engine: SupervisedInference) -> None:
        """Attach the launched vLLM to the shared buffer (its own copy is freed). The first
        launch waits for the trainer, whose parameters then move into the buffer."""
        if self.shared is None:
            trainer = await self._loaded_trainer()
            self.shared = await anyio.to_thread.run_sync(self._share_trainer_weights, trainer)

        assert engine.client is not None
        began = time.perf_counter()
        verify = "true" if self._verify_values else "false"
        try:
            answers = await engine.client.collective_rpc("attach_shared", args=[str(self.shm_dir), verify])
        except InferenceRequestError as exc:
            raise BridgeFailed(f"vLLM could not attach the shared weights in {self.shm_dir}: {exc}") from exc
        self._verify_values = False
        log.info("shared_attached", workers=answers, seconds=round(time.perf_counter() - began, 3))

    # ---- the fence: the optimizer update runs inside the sync ------------------------------
    def sync_due(self, step: int) -> bool:
        return False

    async def fence(self, update: Update) -> SyncRecord | None:
        """Run `update` (the optimizer step) fenced and return the sync it made; raises
        `BridgeFailed` / `ProbeMismatch` as a sync does. Once the bridge is stopping, nothing
        reads the buffer: `update` runs as is."""
        if self.machine.state in (State.STOPPING, State.STOPPED):
            await update()
            return None
        self._update = update
        try:
            return await self.sync_now()
        finally:
            self._update = None

    async def _save(self, version: int) -> Path:
        return self.shm_dir

    async def _apply(self, engine: SupervisedInference, staged: Path, version: int, phases: dict[str, float]) -> None:
        t = time.perf_counter()
        await engine.pause()
        phases["pause"] = time.perf_counter() - t
        # Taken only once vLLM is paused: a sync retried after vLLM died before the pause still
        # has its optimizer step to run; one retried after the step ran has none.
        update, self._update = self._update, None
        if update is not None:
            t = time.perf_counter()
            await update()
            phases["optimizer_step"] = time.perf_counter() - t
        t = time.perf_counter()
        assert engine.client is not None
        await engine.client.end_fence(version)
        phases["reset_resume"] = time.perf_counter() - t

    async def stop(self) -> None:
        await super().stop()
        if self.shm_dir.exists():
            await anyio.to_thread.run_sync(shutil.rmtree, self.shm_dir)
            log.info("shared_dir_removed", directory=str(self.shm_dir))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "shared": self.shared.describe() if self.shared else None}
