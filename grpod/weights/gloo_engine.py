"""The `gloo` weight-transfer backend of vLLM, for CPU engines (and tests), plus its worker extension.

Launch vLLM with

    --worker-extension-cls grpod.weights.gloo_engine.GlooTransferExtension
    --weight-transfer-config '{"backend": "gloo"}'

and `VLLM_SERVER_DEV_MODE=1` (grpod's `InferenceProcess` sets it) for the weight-transfer routes.
vLLM imports the module named by `--worker-extension-cls` in each worker before it loads the model
(`vllm/v1/worker/worker_base.py`), and importing this module registers the `gloo` backend with
`WeightTransferEngineFactory`, so the engine exists by the time the worker creates it
(`Worker.load_model`). vLLM's built-in backends all need CUDA, Ray or an external package.

One update, on each worker, as vLLM's routes drive it:
- `/init_weight_transfer_engine` (`GlooInitInfo`): join the trainer's gloo group (trainer = rank
  0). A new init replaces the previous group: a new trainer re-forms the group without a restart.
- `/start_weight_update`: checks only. The layerwise reload does not start here.
- `/update_weights` (`GlooUpdateInfo`): start vLLM's layerwise reload, receive the chunks rank 0
  broadcasts (`inflight_chunks` receives posted ahead, so chunk k+1 arrives while chunk k loads),
  load each with the model's `load_weights`, finalise the reload. All in this one call.
- `/finish_weight_update`: nothing left to do (vLLM's worker resets LoRA state, the route sets the
  weight version). The prefix cache is NOT reset by any of these routes: the caller must
  (`/reset_prefix_cache`), or prefixes computed with the old weights are served.

Why the reload lives inside one `update_weights` call (vLLM's trap, reproduced on this CPU
build): between `initialize_layerwise_reload` and `finalize_layerwise_reload` the model's
parameters sit on the meta device. A stock engine that loses its trainer in between keeps them
there: `/health` still answers 200, and the next generation request kills EngineCore. Here the
meta state never outlives the call: on any failure (a trainer that died: "Connection closed by
peer"; a timeout; a bad payload) the error path finalises the reload before it raises, layers that
got nothing or only part of their tensors get their previous tensors back, and the group is
closed (the next trainer inits a new one). Layers that got all their tensors keep the new ones:
after a failed update the engine serves a mix of two versions, which the caller must treat as
unusable until a complete update (and the alignment probe) has passed. The failure is recorded in
`grpod_weight_transfer_status()`.

Tied output heads (SmolLM2, small Qwen2.5, Llama 3.2 1B/3B): on CPU the head computes from a
copy of the embedding packed when the model was loaded, and the layerwise reload, which this
update is, leaves that copy stale (measured on the tiny model with tied embeddings: prompt
logprobs 2.03 away from the trainer's after a gloo update). After every reload this engine re-packs
the embedding layers, as grpod's `ReloadExtension` does after vLLM's `reload_weights` (the same
function serves both).

The base class's `update_weights` ends with `torch.accelerator.synchronize()`, which raises on a
CPU-only torch; this engine synchronises only when an accelerator exists.

`GlooTransferExtension` is the one worker extension to launch with: it adds a status call to
grpod's `ReloadExtension` (in-place reload with the tied-head repack), so one
`--worker-extension-cls` serves the `none` bridge and the broadcast transfer alike.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

from grpod.weights.reload_ext import ReloadExtension
from grpod.weights.reload_ext import _reprocess_embeddings as repack_embeddings
from grpod.weights.group import GlooGroup, WeightTransferError
from grpod.weights.wire import GLOO_BACKEND, ChunkEntry, GlooInitInfo, GlooUpdateInfo

log = logging.getLogger(__name__)


@dataclass
class UpdateRecord:
    """What the last `update_weights` call on this worker did (timings in seconds)."""

    ok: bool = False
    error: str | None = None
    chunks_total: int = 0
    chunks_loaded: int = 0
    tensors_loaded: int = 0
    bytes_loaded: int = 0
    receive_wait_s: float = 0.0
    load_s: float = 0.0
    finalize_s: float = 0.0
    total_s: float = 0.0
    # Layers that had received part of their tensors when the update failed; they were given
    # their previous tensors back.
    partial_layers_restored: list[str] = field(default_factory=list)


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """vLLM weight-transfer engine over a stateless gloo group with the trainer at rank 0."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: GlooGroup | None = None
        self.inflight_chunks = 1
        self.last_update: UpdateRecord | None = None
        self.updates_ok = 0
        self.updates_failed = 0

    # -- group ---------------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.shutdown()
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        if rank >= init_info.world_size:
            raise ValueError(
                f"worker rank {rank} (rank_offset {init_info.rank_offset}) does not fit in a group of "
                f"world_size {init_info.world_size}: the trainer counted fewer workers than this engine has"
            )
        self.inflight_chunks = init_info.inflight_chunks
        self.group = GlooGroup.join(
            init_info.master_address,
            init_info.master_port,
            rank=rank,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
        )
        log.info("grpod gloo weight transfer: joined %r", self.group)

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()

    # -- one update ----------------------------------------------------------------------------

    def start_weight_update(self) -> None:
        if self.group is None:
            raise WeightTransferError(
                "no gloo weight-transfer group on this worker (never initialised, shut down, or closed "
                "by a failed update): call /init_weight_transfer_engine first"
            )

    def finish_weight_update(self) -> None:
        """Nothing to do: `update_weights` finalised the reload (see the module docstring)."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            typed = self.parse_update_info(update_info)
        except BaseException:
            # Rank 0 is already sending: closing this end makes its send fail now rather than at
            # its timeout.
            self.shutdown()
            raise
        self.receive_weights(typed)
        # The base class synchronises unconditionally, which raises on a CPU-only torch.
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        if self.group is None:
            self.start_weight_update()  # raises the no-group error
        record = UpdateRecord(chunks_total=len(update_info.chunk_counts))
        self.last_update = record
        began = time.perf_counter()
        initialize_layerwise_reload(self.model)
        try:
            with disable_mtp_completeness_check():
                self._receive_and_load(update_info, record)
        except BaseException as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            self.updates_failed += 1
            self._abandon_reload(record)
            self.shutdown()
            log.error(
                "grpod gloo weight transfer: update failed after %d/%d chunks; previous tensors restored "
                "where a layer was incomplete, group closed: %s",
                record.chunks_loaded,
                record.chunks_total,
                record.error,
            )
            if isinstance(exc, WeightTransferError):
                raise
            raise WeightTransferError(f"weight update failed after {record.chunks_loaded} chunks: {record.error}") from exc
        finalized = time.perf_counter()
        finalize_layerwise_reload(self.model, self.model_config)
        repack_embeddings(self.model)
        record.finalize_s = time.perf_counter() - finalized
        record.total_s = time.perf_counter() - began
        record.ok = True
        self.updates_ok += 1

    def _receive_and_load(self, update_info: GlooUpdateInfo, record: UpdateRecord) -> None:
        group = self.group
        chunks = list(update_info.chunks())
        pending: deque[tuple[int, list[ChunkEntry], torch.Tensor, Any]] = deque()
        posted = 0

        def post_next() -> None:
            nonlocal posted
            entries = chunks[posted]
            buffer = torch.empty(sum(e.nbytes for e in entries), dtype=torch.uint8)
            pending.append((posted, entries, buffer, group.broadcast(buffer)))
            posted += 1

        while posted < min(self.inflight_chunks, len(chunks)):
            post_next()
        while pending:
            index, entries, buffer, work = pending.popleft()
            waited = time.perf_counter()
            group.wait(work, f"receiving chunk {index + 1}/{len(chunks)} ({buffer.numel()} bytes)")
            loading = time.perf_counter()
            record.receive_wait_s += loading - waited
            if posted < len(chunks):
                post_next()
            # Fresh buffer per chunk: the layerwise reload keeps references to what it is given
            # until each layer is complete, so a reused buffer would be overwritten under it.
            self.model.load_weights(
                unpack_tensor(
                    buffer,
                    [e.name for e in entries],
                    [e.shape for e in entries],
                    [e.dtype for e in entries],
                    [e.nbytes for e in entries],
                )
            )
            record.load_s += time.perf_counter() - loading
            record.chunks_loaded += 1
            record.tensors_loaded += len(entries)
            record.bytes_loaded += buffer.numel()

    def _abandon_reload(self, record: UpdateRecord) -> None:
        """Finalise a reload that will not complete, leaving no parameter on the meta device.

        vLLM's `finalize_layerwise_reload` gives layers that received nothing their previous
        tensors back, but processes a layer that received part of its tensors ("Delayed
        processing") from a buffer of uninitialised memory for the rest (`materialize_layer`
        allocates with `empty_strided`; vllm/model_executor/model_loader/reload/layerwise.py and
        meta.py). Measured with the tiny model, a sender killed after 3 of 11 chunks (q/k/v and
        gate but not up received for layer 0): with finalize alone the engine stayed up but its
        prompt logprobs were not finite (HTTP 400 "Out of range float values are not JSON
        compliant"); with this, finite, a mix of the two versions. Such layers are first made to
        look untouched, so they get their previous tensors back too.
        """
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        for name, layer in self.model.named_modules():
            info = LAYERWISE_INFO.get(layer)
            if info is None or not info.can_load() or is_deferred_attention_layer(layer):
                continue
            if info.load_numel > 0:
                record.partial_layers_restored.append(name)
                info.load_numel = 0
                info.loaded_weights.clear()
        finalize_layerwise_reload(self.model, self.model_config)
        repack_embeddings(self.model)

    # -- introspection -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        group = self.group
        return {
            "backend": GLOO_BACKEND,
            "group": None
            if group is None
            else {"address": f"{group.host}:{group.port}", "rank": group.rank, "world_size": group.world_size},
            "updates_ok": self.updates_ok,
            "updates_failed": self.updates_failed,
            "last_update": None if self.last_update is None else asdict(self.last_update),
        }


def register() -> None:
    """Register the `gloo` backend with vLLM (idempotent: this module is imported once per
    process, but a re-import or an explicit call must not fail)."""
    try:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)
    except ValueError:
        log.debug("weight transfer backend %r already registered", GLOO_BACKEND)


register()


class GlooTransferExtension(ReloadExtension):
    """Worker extension: grpod's `ReloadExtension` plus the gloo transfer's status.

    Importing this class's module registers the `gloo` backend (above); its method is called
    through `/collective_rpc`, one result per worker.
    """

    def grpod_weight_transfer_status(self) -> dict[str, Any]:
        """The worker's transfer engine state (group, last update: chunks, timings, error) and the
        names of any parameter or buffer on the meta device (none, unless an update is stuck)."""
        engine = getattr(self, "weight_transfer_engine", None)
        model = self.model_runner.get_model()
        meta = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
        state: dict[str, Any] = {"configured": engine is not None, "meta_tensors": meta}
        if isinstance(engine, GlooWeightTransferEngine):
            state |= engine.status()
        elif engine is not None:
            state["backend"] = type(engine).__name__
        return state
