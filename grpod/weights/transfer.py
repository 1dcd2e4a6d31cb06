"""The trainer's side of a weight transfer to N vLLM engines: rank 0 of one group, plus HTTP fan-out.

The pieces, each owning one resource:
- `EngineWeightClient`: grpod's `InferenceClient` for one engine, plus vLLM's weight-transfer
  routes (`/get_world_size`, `/init_weight_transfer_engine`, `/start_weight_update`,
  `/update_weights`, `/finish_weight_update`, `/shutdown_weight_transfer_engine`; they exist only
  with `VLLM_SERVER_DEV_MODE=1`). Answers carry the launch token when the client has one.
- `EngineFanout`: one route on every engine at once; waits for all of them and raises one
  `EngineFanoutError` that names each engine that failed and why.
- `GlooWeightSender` / `NcclWeightSender`: rank 0's end of the data plane. Both pre-bind the
  group's listening socket when constructed (torchrun trap, see `grpod.weights.group`) and
  expose the same five calls (`engine_init_info`, `update_info`, `join`, `broadcast`, `close`).
- `WeightGroup` (`open_weight_group`): one formed group over the engines (a membership epoch):
  forms it (the engines' init and rank 0's join run concurrently: they rendezvous), runs a sync
  (start → update on the engines while rank 0 broadcasts → finish with the weight version), and
  shuts the engines' side down at exit. A sync that fails breaks the group: open a new one.

What a sync does not do: fence generation (pause/resume) and reset the prefix cache. vLLM's
`finish_weight_update` does not reset it, and cached prefixes from the old weights would be
served; the caller fences (grpod's `/grpod/pause` … `/grpod/resume`, which resets it).

Transports. `gloo` runs anywhere (CPU, tests) with the `gloo` backend of
`grpod.weights.gloo_engine`; every wait is bounded by `timeout_s`. `nccl` uses vLLM's own NCCL
engine and helpers (`nccl_common`, `packed_nccl_broadcast_producer`): it needs CUDA on the trainer
and the engines and has not run on these CPU machines (its argument building is unit-tested). A
failed NCCL broadcast cannot be interrupted (vLLM documents that a worker whose peer died stays
blocked in NCCL): `NcclWeightSender.broadcast` gives up after `timeout_s` per chunk and the
group's engines must then be relaunched.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Literal

import anyio
import structlog
import torch
from pydantic import BaseModel, ConfigDict, Field

from grpod.inference.client import InferenceClient
from grpod.inference.release import ReleaseTimeoutError, wait_port_free, wait_until
from grpod.weights.group import (
    GlooGroup,
    WeightTransferCancelled,
    WeightTransferError,
    WeightTransferTimeout,
    listen_on,
    releasing,
)
from grpod.weights.wire import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_INFLIGHT_CHUNKS,
    DEFAULT_TIMEOUT_S,
    GlooInitInfo,
    GlooUpdateInfo,
    dtype_name,
)

log = structlog.get_logger(__name__)

# The worker extension every engine of a weight group is launched with (it registers `gloo`).
ENGINE_EXTENSION = "grpod.weights.gloo_engine.GlooTransferExtension"

NamedTensors = Sequence[tuple[str, torch.Tensor]]
TensorMeta = tuple[str, torch.dtype, tuple[int, ...]]
# After the engines' side of a sync failed, rank 0's broadcast gets this long to notice the cancel
# (a few wait slices) before its thread is abandoned.
RANK0_GRACE_S = 2.0
# HTTP answers for calls that only switch state (start, finish, shutdown) come back in milliseconds.
CONTROL_TIMEOUT_S = 60.0
# Releasing a broken group (`WeightGroup.shutdown`): an engine that is not blocked in the failed
# collective answers in milliseconds; one that is gets the calls queued behind it.
BROKEN_RELEASE_WAIT_S = 2.0


class TransferConfig(BaseModel):
    """The trainer's knobs for a weight transfer (one section of a future bridge config)."""

    model_config = ConfigDict(extra="forbid")

    transport: Literal["gloo", "nccl"] = "gloo"
    # The address rank 0 listens on; the engines connect to it. 127.0.0.1 for engines on this
    # machine, a routable address of the trainer for engines elsewhere.
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0 = a free one, bound before anyone connects
    chunk_bytes: int = Field(DEFAULT_CHUNK_BYTES, ge=1)
    inflight_chunks: int = Field(DEFAULT_INFLIGHT_CHUNKS, ge=1)
    # Bounds forming the group and each collective wait, on both sides.
    timeout_s: float = Field(DEFAULT_TIMEOUT_S, gt=0)


def engine_launch_args(transport: Literal["gloo", "nccl"] = "gloo") -> list[str]:
    """vLLM arguments for an engine of a weight group (add them to `inference.extra_args`; launch
    with `worker_extension=ENGINE_EXTENSION`; the routes need `VLLM_SERVER_DEV_MODE=1`)."""
    return ["--weight-transfer-config", json.dumps({"backend": transport})]


# -- HTTP: one engine, N engines ---------------------------------------------------------------


class EngineWeightClient(InferenceClient):
    """`InferenceClient` plus vLLM's weight-transfer routes, for one engine (use as `async with`)."""

    @classmethod
    def for_process(cls, process, timeout_s: float | None = None) -> EngineWeightClient:
        """A client for the server an `InferenceProcess` launched (its URL, API key and token)."""
        base = process.client(timeout_s)
        return cls(base.base_url, base.timeout_s, process.cfg.api_key, launch_token=base.launch_token)

    async def world_size(self) -> int:
        """Workers this engine puts in a weight-transfer group: TP x PP x DP."""
        answer = await self._request("GET", "/get_world_size", params={"include_dp": "true"})
        return int(answer["world_size"])

    async def init_weight_transfer_engine(self, init_info: dict[str, Any], *, timeout_s: float) -> None:
        """Blocks until every worker of this engine joined the group (or its timeout)."""
        await self._request("POST", "/init_weight_transfer_engine", json_body={"init_info": init_info}, timeout_s=timeout_s)

    async def start_weight_update(self) -> None:
        await self._request("POST", "/start_weight_update", timeout_s=CONTROL_TIMEOUT_S)

    async def update_weights(self, update_info: dict[str, Any], *, timeout_s: float) -> None:
        """Returns once the engine received and loaded every chunk of the update."""
        await self._request("POST", "/update_weights", json_body={"update_info": update_info}, timeout_s=timeout_s)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._request(
            "POST", "/finish_weight_update", json_body={"weight_version": weight_version}, timeout_s=CONTROL_TIMEOUT_S
        )

    async def shutdown_weight_transfer_engine(self) -> None:
        await self._request("POST", "/shutdown_weight_transfer_engine", timeout_s=CONTROL_TIMEOUT_S)


class EngineFanoutError(WeightTransferError):
    """A route failed on some engines. `failures` maps each failed engine's URL to its error;
    `abandoned` lists the engines whose call was still running when the first failure came (their
    engine finishes it on its own, bounded by its timeout)."""

    def __init__(self, route: str, failures: dict[str, BaseException], abandoned: list[str], engines: int) -> None:
        self.route = route
        self.failures = failures
        self.abandoned = abandoned
        detail = "; ".join(f"{url}: {exc}" for url, exc in failures.items())
        if abandoned:
            detail += f" (not waited for: {', '.join(abandoned)})"
        super().__init__(f"{route} failed on {len(failures)} of {engines} engines: {detail}")


class EngineFanout:
    """Calls one route on every engine concurrently (use as `async with`: it opens the clients).

    The first failure ends the call: the engines of one group are told the same thing or the
    group is lost, and an engine that is still blocked in a collective (joining, receiving) would
    only end by its own timeout, which the caller must not wait for.
    """

    def __init__(self, clients: Sequence[EngineWeightClient]) -> None:
        if not clients:
            raise ValueError("a weight transfer needs at least one engine")
        self.clients = list(clients)
        self._stack = AsyncExitStack()

    async def __aenter__(self) -> EngineFanout:
        for client in self.clients:
            await self._stack.enter_async_context(client)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()

    @property
    def urls(self) -> list[str]:
        return [c.base_url for c in self.clients]

    async def call(self, route: str, calls: Sequence[Any]) -> list[Any]:
        """Await `calls[i]` (a coroutine for engine i) concurrently; the results in engine order,
        or `EngineFanoutError` at the first failure (those failing together are all named)."""
        results: list[Any] = [None] * len(calls)
        failures: dict[str, BaseException] = {}
        running = set(range(len(calls)))

        async def one(i: int, call, group) -> None:
            try:
                results[i] = await call
            except Exception as exc:
                failures[self.clients[i].base_url] = exc
                group.cancel_scope.cancel()
            finally:
                running.discard(i)

        async with anyio.create_task_group() as group:
            for i, call in enumerate(calls):
                group.start_soon(one, i, call, group)
        if failures:
            abandoned = [self.clients[i].base_url for i in sorted(running)]
            raise EngineFanoutError(route, failures, abandoned, len(calls))
        return results

    async def each(self, calls: Sequence[Any], *, timeout_s: float) -> dict[str, BaseException]:
        """Await `calls[i]` (a coroutine for engine i) concurrently, each until it ends or
        `timeout_s` (one engine's failure abandons no other); the failures by engine URL
        (`TimeoutError` for an engine that did not answer in time)."""
        failures: dict[str, BaseException] = {}

        async def one(i: int, call) -> None:
            try:
                with anyio.fail_after(timeout_s):
                    await call
            except Exception as exc:
                failures[self.clients[i].base_url] = exc

        async with anyio.create_task_group() as group:
            for i, call in enumerate(calls):
                group.start_soon(one, i, call)
        return failures

    async def world_sizes(self) -> list[int]:
        return await self.call("/get_world_size", [c.world_size() for c in self.clients])

    async def init_weight_transfer_engine(self, init_infos: Sequence[dict[str, Any]], *, timeout_s: float) -> None:
        await self.call(
            "/init_weight_transfer_engine",
            [c.init_weight_transfer_engine(info, timeout_s=timeout_s) for c, info in zip(self.clients, init_infos, strict=True)],
        )

    async def start_weight_update(self) -> None:
        await self.call("/start_weight_update", [c.start_weight_update() for c in self.clients])

    async def update_weights(self, update_info: dict[str, Any], *, timeout_s: float) -> None:
        await self.call("/update_weights", [c.update_weights(update_info, timeout_s=timeout_s) for c in self.clients])

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.call("/finish_weight_update", [c.finish_weight_update(weight_version) for c in self.clients])


def rank_offsets(world_sizes: Sequence[int]) -> list[int]:
    """The group rank of each engine's first worker: the trainer is 0, engines follow in order."""
    offsets, next_rank = [], 1
    for size in world_sizes:
        if size < 1:
            raise ValueError(f"an engine reported world size {size}")
        offsets.append(next_rank)
        next_rank += size
    return offsets


# -- rank 0's data plane -----------------------------------------------------------------------


@dataclass
class BroadcastStats:
    """What one `broadcast` sent and how long rank 0 spent packing and sending."""

    chunks: int = 0
    tensors: int = 0
    bytes: int = 0
    pack_s: float = 0.0
    send_wait_s: float = 0.0
    total_s: float = 0.0


class WeightSender(ABC):
    """Rank 0 of a weight-transfer group. Constructing one binds and listens on its socket, so
    the port is taken before any engine is told it, and forming the group never depends on
    torch's rendezvous choosing rank 0's role (the torchrun trap, `grpod.weights.group`)."""

    transport: str

    def __init__(
        self,
        host: str,
        world_size: int,
        *,
        port: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        inflight_chunks: int = DEFAULT_INFLIGHT_CHUNKS,
    ) -> None:
        if world_size < 2:
            raise ValueError(f"a weight-transfer group needs the trainer and at least one worker, got world_size {world_size}")
        self.host = host
        self.world_size = world_size
        self.chunk_bytes = chunk_bytes
        self.timeout_s = timeout_s
        self.inflight_chunks = inflight_chunks
        self._socket: socket.socket | None = listen_on(host, port)
        self.port: int = self._socket.getsockname()[1]
        self._closed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(tcp://{self.host}:{self.port}, world_size {self.world_size})"

    def _take_socket(self) -> socket.socket:
        """The listening socket, handed to the group's store (once)."""
        if self._socket is None:
            raise WeightTransferError(f"{self!r}: join() once per sender; its socket went to the first group (or it is closed)")
        sock, self._socket = self._socket, None
        return sock

    @abstractmethod
    def engine_init_info(self, rank_offset: int) -> dict[str, Any]:
        """The `init_info` of `/init_weight_transfer_engine` for the engine whose first worker has
        group rank `rank_offset`."""

    @abstractmethod
    def update_info(self, metadata: Sequence[TensorMeta]) -> dict[str, Any]:
        """The `update_info` of `/update_weights` for tensors described by (name, dtype, shape)."""

    @abstractmethod
    def join(self) -> None:
        """Form the group as rank 0 (blocking; concurrently with the engines' init)."""

    @abstractmethod
    def broadcast(
        self, named_tensors: NamedTensors, update_info: dict[str, Any], cancel: threading.Event | None = None
    ) -> BroadcastStats:
        """Send the tensors `update_info` announced, in its order (blocking)."""

    def close(self) -> None:
        """Release the socket and the group (idempotent; never blocks)."""
        self._closed = True
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        self._close_group()

    @abstractmethod
    def _close_group(self) -> None: ...


class TransportUnavailable(WeightTransferError):
    """The transport cannot run in this process (NCCL without CUDA)."""


def tensor_metadata(named_tensors: NamedTensors) -> list[TensorMeta]:
    return [(name, t.dtype, tuple(t.shape)) for name, t in named_tensors]


class GlooWeightSender(WeightSender):
    """Rank 0 of a gloo weight-transfer group (CPU tensors; any device is copied to CPU)."""

    transport = "gloo"
    group: GlooGroup | None = None

    def engine_init_info(self, rank_offset: int) -> dict[str, Any]:
        return asdict(
            GlooInitInfo(
                master_address=self.host,
                master_port=self.port,
                rank_offset=rank_offset,
                world_size=self.world_size,
                timeout_s=self.timeout_s,
                inflight_chunks=self.inflight_chunks,
            )
        )

    def update_info(self, metadata: Sequence[TensorMeta]) -> dict[str, Any]:
        return asdict(GlooUpdateInfo.plan(metadata, self.chunk_bytes))

    def join(self) -> None:
        group = GlooGroup.join(
            self.host, self.port, rank=0, world_size=self.world_size, timeout_s=self.timeout_s, listen_socket=self._take_socket()
        )
        if self._closed:  # closed while this join was blocked (an abandoned group formation)
            group.close()
            raise WeightTransferCancelled(f"{self!r} was closed while forming its group")
        self.group = group

    def broadcast(
        self, named_tensors: NamedTensors, update_info: dict[str, Any], cancel: threading.Event | None = None
    ) -> BroadcastStats:
        """Pack the tensors into the chunks `update_info` planned (vLLM's `pack_tensors`) and
        broadcast each, `inflight_chunks` at a time; every wait bounded by `timeout_s`."""
        group = self.group
        if group is None:
            raise WeightTransferError(f"{self!r}: broadcast() before join() (or after close())")
        plan = GlooUpdateInfo(**update_info)
        _check_against_plan(named_tensors, plan)
        try:
            return self._send(group, named_tensors, plan, cancel)
        except Exception as exc:
            failure = _detached(self, exc)
        raise failure  # outside the handler: no context (`_detached`)

    def _send(self, group: GlooGroup, named_tensors: NamedTensors, plan: GlooUpdateInfo,
              cancel: threading.Event | None) -> BroadcastStats:
        from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

        stats = BroadcastStats()
        began = time.perf_counter()
        stream = iter(named_tensors)
        pending: list[tuple[int, Any, Any]] = []  # (index, chunk kept alive until sent, work)
        chunk_count = len(plan.chunk_counts)

        def wait_oldest() -> None:
            index, chunk, work = pending.pop(0)
            waited = time.perf_counter()
            group.wait(work, f"sending chunk {index + 1}/{chunk_count} ({chunk.packed_tensor.numel()} bytes)", cancel)
            stats.send_wait_s += time.perf_counter() - waited

        chunk_entries = list(plan.chunks())
        first = 0
        for index, count in enumerate(plan.chunk_counts):
            if len(pending) >= self.inflight_chunks:
                wait_oldest()
            packing = time.perf_counter()
            planned = plan.names[first : first + count]
            planned_bytes = sum(e.nbytes for e in chunk_entries[index])
            first += count
            # The plan decided the cut; given exactly this chunk's tensors and its size as the
            # bound, pack_tensors packs them all (and does not warn about a tensor larger than
            # chunk_bytes, which is a chunk of its own by the plan).
            chunk = pack_tensors(_take(stream, count), _as_cpu, planned_bytes)
            stats.pack_s += time.perf_counter() - packing
            if chunk is None or chunk.names != planned:
                raise WeightTransferError(f"{self!r}: chunk {index + 1} packed {chunk and chunk.names} where the plan has {planned}")
            pending.append((index, chunk, group.broadcast(chunk.packed_tensor)))
            stats.chunks += 1
            stats.tensors += count
            stats.bytes += chunk.packed_tensor.numel()
        while pending:
            wait_oldest()
        stats.total_s = time.perf_counter() - began
        return stats

    def _close_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def _take(stream, count: int):
    for _ in range(count):
        yield next(stream)


def _as_cpu(item: tuple[str, torch.Tensor]) -> torch.Tensor:
    return item[1].detach().cpu()


def _detached(sender: WeightSender, exc: BaseException) -> WeightTransferError:
    """A broadcast's failure as a fresh error of the same message (a `WeightTransferError` keeps its
    type), holding nothing of `exc`: raised with no cause, outside any handler and with `exc` kept
    in no local. `exc`'s traceback holds the frames of the send, and they the group (gloo: its
    pending works; NCCL: the communicator) and its store, and with them rank 0's port, for as
    long as the daemon keeps the sync's error (measured: a fixed bridge.port held until the
    daemon dropped it; CI, fault case 13)."""
    if isinstance(exc, WeightTransferError):
        return type(exc)(str(exc))
    return WeightTransferError(f"{sender!r}: broadcast failed: {type(exc).__name__}: {exc}")


def _check_against_plan(named_tensors: NamedTensors, plan: GlooUpdateInfo) -> None:
    """The engines size their receive buffers from the plan; tensors that differ from it would
    hang or garble the transfer, so they are refused before anything is sent."""
    if len(named_tensors) != len(plan.names):
        raise ValueError(f"{len(named_tensors)} tensors to send, the update info announced {len(plan.names)}")
    for i, ((name, tensor), want_name, want_dtype, want_shape) in enumerate(
        zip(named_tensors, plan.names, plan.dtype_names, plan.shapes, strict=True)
    ):
        if name != want_name or dtype_name(tensor.dtype) != want_dtype or list(tensor.shape) != list(want_shape):
            raise ValueError(
                f"tensor {i} is {name!r} {dtype_name(tensor.dtype)} {list(tensor.shape)}, the update info "
                f"announced {want_name!r} {want_dtype} {list(want_shape)}"
            )


class NcclWeightSender(WeightSender):
    """Rank 0 of an NCCL weight-transfer group, for vLLM's built-in `nccl` backend (engines
    launched with `--weight-transfer-config '{"backend": "nccl"}'`). CUDA only; not run on the CPU
    machines this was written on.

    It is vLLM's `NCCLTrainerWeightTransferEngine` taken apart so the fan-out can drive N engines:
    the same worker init payload (`NCCLWeightTransferInitInfo`, packed, via `worker_init_payload`),
    the same update info, the same packed producer. One difference: rank 0 forms its
    `StatelessProcessGroup` on the socket it bound at construction (`listen_socket=`), where vLLM's
    `nccl_common.trainer_init` binds inside `StatelessProcessGroup.create` after the engines were
    told the port (a race), and which under torchrun is the same trap as gloo's.
    """

    transport = "nccl"
    communicator = None

    def engine_init_info(self, rank_offset: int) -> dict[str, Any]:
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

        return worker_init_payload(
            NCCLWeightTransferInitInfo(
                master_address=self.host,
                master_port=self.port,
                rank_offset=rank_offset,
                world_size=self.world_size,
                packed=True,
                packed_buffer_size_bytes=self.chunk_bytes,
                packed_num_buffers=self.inflight_chunks,
            )
        )

    def update_info(self, metadata: Sequence[TensorMeta]) -> dict[str, Any]:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

        return asdict(
            NCCLWeightTransferUpdateInfo(
                names=[name for name, _, _ in metadata],
                dtype_names=[dtype_name(dtype) for _, dtype, _ in metadata],
                shapes=[list(shape) for _, _, shape in metadata],
            )
        )

    def join(self) -> None:
        if not torch.cuda.is_available():
            raise TransportUnavailable(
                "transport 'nccl' needs CUDA on the trainer and the engines; this process has no CUDA "
                "device: use transport = 'gloo'"
            )
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.utils.nccl import unpinned_nccl_env

        store_group = StatelessProcessGroup.create(
            host=self.host,
            port=self.port,
            rank=0,
            world_size=self.world_size,
            store_timeout=int(self.timeout_s),
            listen_socket=self._take_socket(),
        )
        with unpinned_nccl_env():
            communicator = PyNcclCommunicator(store_group, device=torch.accelerator.current_device_index())
        if self._closed:  # closed while this join was blocked (an abandoned group formation), as gloo's
            communicator.destroy()
            raise WeightTransferCancelled(f"{self!r} was closed while forming its group")
        self.communicator = communicator

    def broadcast(
        self, named_tensors: NamedTensors, update_info: dict[str, Any], cancel: threading.Event | None = None
    ) -> BroadcastStats:
        """vLLM's packed NCCL producer in a thread of its own, given up once no tensor moved for
        `timeout_s` (one deadline of `timeout_s` x chunks let a vanished peer hold a 7B model's
        sync for hours). NCCL cannot be interrupted: on a timeout (or `cancel`) that thread stays
        blocked and the group is unusable (relaunch its engines)."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        if self.communicator is None:
            raise WeightTransferError(f"{self!r}: broadcast() before join()")
        device = torch.device("cuda", torch.accelerator.current_device_index())
        chunks = max(1, len(GlooUpdateInfo.plan(tensor_metadata(named_tensors), self.chunk_bytes).chunk_counts))
        outcome: dict[str, BaseException] = {}
        began = time.perf_counter()
        moved = [time.monotonic()]  # when the producer last took a tensor: the broadcast's progress

        def next_tensor(item):
            moved[0] = time.monotonic()
            return item[1].detach().to(device)

        def produce() -> None:
            try:
                packed_nccl_broadcast_producer(
                    iterator=iter(named_tensors),
                    group=self.communicator,
                    src=0,
                    post_iter_func=next_tensor,
                    buffer_size_bytes=self.chunk_bytes,
                    num_buffers=self.inflight_chunks,
                )
                torch.cuda.current_stream().synchronize()
            except BaseException as exc:  # reported by the waiting thread
                outcome["error"] = exc

        worker = threading.Thread(target=produce, name="grpod-nccl-broadcast", daemon=True)
        worker.start()
        while worker.is_alive():
            if cancel is not None and cancel.is_set():
                raise WeightTransferCancelled(f"{self!r}: broadcast given up; the NCCL group is unusable, relaunch its engines")
            if time.monotonic() - moved[0] > self.timeout_s:
                raise WeightTransferTimeout(
                    f"{self!r}: broadcast of {chunks} chunks: no tensor moved for {self.timeout_s:g} s; "
                    "the NCCL group is unusable, relaunch its engines"
                )
            worker.join(0.2)
        if "error" in outcome:
            raise _detached(self, outcome.pop("error"))  # the producer's error is kept nowhere (`_detached`)
        total = sum(t.numel() * t.element_size() for _, t in named_tensors)
        return BroadcastStats(chunks=chunks, tensors=len(named_tensors), bytes=total, total_s=time.perf_counter() - began)

    def _close_group(self) -> None:
        if self.communicator is not None:
            self.communicator.destroy()
            self.communicator = None


def make_sender(cfg: TransferConfig, world_size: int) -> WeightSender:
    """The sender of `cfg.transport`, its socket bound."""
    cls = {"gloo": GlooWeightSender, "nccl": NcclWeightSender}[cfg.transport]
    return cls(
        cfg.host,
        world_size,
        port=cfg.port,
        chunk_bytes=cfg.chunk_bytes,
        timeout_s=cfg.timeout_s,
        inflight_chunks=cfg.inflight_chunks,
    )


# -- one group over N engines ------------------------------------------------------------------


@dataclass
class SyncTimings:
    """Wall-clock seconds of one sync's phases, seen from the trainer.

    `update_s` is the engines' `/update_weights` (receive + load + finalise, the slowest engine);
    `broadcast` is rank 0's side of the same interval, which it overlaps.
    """

    start_s: float = 0.0
    update_s: float = 0.0
    finish_s: float = 0.0
    total_s: float = 0.0
    broadcast: BroadcastStats = field(default_factory=BroadcastStats)


class WeightGroup:
    """One formed weight-transfer group: rank 0 here, the engines' workers at ranks 1..N.

    Obtained from `open_weight_group`. One sync at a time. A failed sync (or formation) leaves
    the group `broken`: the engines closed their side (gloo engine) or are stuck (NCCL), and
    serve a mix of weights until a complete update; open a new group.

    An update session (vLLM's worker state between `/start_weight_update` and
    `/finish_weight_update`) that a failed sync leaves open on an engine that completed its part
    (another engine failed, or rank 0 gave up after this one received everything) would make that
    engine refuse every later start ("already active") and its release, in this group and the
    next: `shutdown` finishes it first.
    """

    def __init__(self, fanout: EngineFanout, sender: WeightSender, offsets: list[int], cfg: TransferConfig) -> None:
        self.fanout = fanout
        self.sender = sender
        self.rank_offsets = offsets
        self.cfg = cfg
        self.formation_s = 0.0
        self.broken: str | None = None
        self.session_open = False

    async def form(self) -> None:
        """The engines' init and rank 0's join, concurrently (they rendezvous)."""
        began = time.perf_counter()
        infos = [self.sender.engine_init_info(offset) for offset in self.rank_offsets]
        # The HTTP wait covers the engines' own bounded join plus the answer's way back.
        http_timeout = self.cfg.timeout_s + CONTROL_TIMEOUT_S
        try:
            await self._rendezvous(
                "forming the weight-transfer group",
                partial(self.fanout.init_weight_transfer_engine, infos, timeout_s=http_timeout),
                lambda cancel: self.sender.join(),
                grace_s=0.0,
            )
        except BaseException as exc:
            self.fail(f"forming the group failed: {type(exc).__name__}")
            raise
        self.formation_s = time.perf_counter() - began
        log.info(
            "weight_group_formed",
            transport=self.sender.transport,
            address=f"{self.sender.host}:{self.sender.port}",
            world_size=self.sender.world_size,
            engines=self.fanout.urls,
            elapsed_s=round(self.formation_s, 3),
        )

    async def sync(self, named_tensors: NamedTensors, *, weight_version: str | None = None) -> SyncTimings:
        """Send `named_tensors` (HF names, as the model's `load_weights` takes them; the whole
        model) to every engine: start, update while rank 0 broadcasts, finish with
        `weight_version`. Raises `WeightTransferError` (the group is then broken)."""
        if self.broken:
            raise WeightTransferError(f"weight group is broken ({self.broken}); open a new one")
        named_tensors = list(named_tensors)
        update_info = self.sender.update_info(tensor_metadata(named_tensors))
        chunks = len(update_info.get("chunk_counts", ())) or 1
        # The engines' update waits up to timeout_s per chunk, then loads; the HTTP wait covers it.
        http_timeout = self.cfg.timeout_s * (chunks + 1) + CONTROL_TIMEOUT_S
        timings = SyncTimings()
        began = time.perf_counter()
        try:
            self.session_open = True
            await self.fanout.start_weight_update()
            timings.start_s = time.perf_counter() - began
            updating = time.perf_counter()
            timings.broadcast = await self._rendezvous(
                f"weight update to version {weight_version}",
                partial(self.fanout.update_weights, update_info, timeout_s=http_timeout),
                partial(self.sender.broadcast, named_tensors, update_info),
                grace_s=RANK0_GRACE_S,
            )
            timings.update_s = time.perf_counter() - updating
            finishing = time.perf_counter()
            await self.fanout.finish_weight_update(weight_version)
            self.session_open = False
            timings.finish_s = time.perf_counter() - finishing
        except BaseException as exc:
            self.fail(f"sync to version {weight_version} failed: {type(exc).__name__}")
            raise
        timings.total_s = time.perf_counter() - began
        log.info(
            "weight_sync",
            transport=self.sender.transport,
            version=weight_version,
            engines=len(self.fanout.clients),
            bytes=timings.broadcast.bytes,
            chunks=timings.broadcast.chunks,
            start_s=round(timings.start_s, 4),
            update_s=round(timings.update_s, 4),
            finish_s=round(timings.finish_s, 4),
            total_s=round(timings.total_s, 4),
        )
        return timings

    def fail(self, reason: str) -> None:
        """Mark the group broken (the first reason stays): its release then waits for no engine
        longer than `BROKEN_RELEASE_WAIT_S`, and it runs no more syncs. Its user calls this for a
        failure around a sync (an engine that did not answer its pause)."""
        if self.broken is None:
            self.broken = reason

    async def _rendezvous(self, what: str, engines_call, rank0_call, *, grace_s: float):
        """The engines' HTTP call and rank 0's blocking call (in a thread, given a cancel event),
        concurrently; rank 0's result.

        Whichever side fails first makes the other give up: the HTTP wait at once; rank 0's
        thread is told (the cancel event; a broadcast polls it between wait slices) and given
        `grace_s` to return, then abandoned: it ends by its own timeout, its end of the group
        already closed (a join blocked in torch, or a send stuck on an engine that died, cannot be
        interrupted sooner). A cancelled caller abandons it at once. One `WeightTransferError`
        reports both sides.
        """
        cancel = threading.Event()
        rank0_done = anyio.Event()
        engines_error: BaseException | None = None
        rank0_error: BaseException | None = None
        result = None

        async def engines() -> None:
            nonlocal engines_error
            try:
                await engines_call()
            except Exception as exc:
                engines_error = exc
                cancel.set()
                with anyio.move_on_after(grace_s):
                    await rank0_done.wait()
                rank0_scope.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(engines)
            with anyio.CancelScope() as rank0_scope:
                try:
                    result = await anyio.to_thread.run_sync(partial(rank0_call, cancel), abandon_on_cancel=True)
                except anyio.get_cancelled_exc_class():
                    cancel.set()
                    raise
                except Exception as exc:
                    rank0_error = exc
                    group.cancel_scope.cancel()
                finally:
                    rank0_done.set()
        if engines_error is None and rank0_error is None:
            return result
        await self._close_sender()
        parts = [f"engines: {engines_error}"] if engines_error is not None else []
        if rank0_error is not None and not isinstance(rank0_error, WeightTransferCancelled):
            parts.append(f"rank 0: {rank0_error}")
        if not parts:
            parts.append("rank 0 gave up")
        raise WeightTransferError(f"{what} failed; " + "; ".join(parts)) from (engines_error or rank0_error)

    async def shutdown(self) -> None:
        """Release the engines' side and rank 0's; best effort, engine by engine (one that is gone
        is logged and keeps no other from its release).

        A healthy group's engines are idle and answer in milliseconds (each is waited for
        `CONTROL_TIMEOUT_S`). A broken group's engines may still be blocked in the collective that
        failed (a join or a receive ends at its own timeout); an engine runs these calls in order
        after it, so each is sent and waited for `BROKEN_RELEASE_WAIT_S` only. An update session
        the failed sync left open (see the class docstring) is finished first: where the engine's
        own update failed (vLLM closed the session) or the engine is gone, that finish fails, as
        expected."""
        wait_s = BROKEN_RELEASE_WAIT_S if self.broken else CONTROL_TIMEOUT_S
        clients = self.fanout.clients

        def described(failures: dict[str, BaseException]) -> dict[str, str]:
            return {url: f"{type(exc).__name__}: {exc}" for url, exc in failures.items()}

        try:
            if self.session_open:
                self.session_open = False
                unfinished = await self.fanout.each([c.finish_weight_update() for c in clients], timeout_s=wait_s)
                log.info(
                    "weight_update_session_closed",
                    finished=[c.base_url for c in clients if c.base_url not in unfinished],
                    not_open_or_gone=described(unfinished),
                )
            failures = await self.fanout.each([c.shutdown_weight_transfer_engine() for c in clients], timeout_s=wait_s)
            if failures:
                log.warning("weight_group_shutdown_failed", engines=described(failures))
        finally:
            await self._close_sender()

    async def _close_sender(self) -> None:
        """Rank 0's side closed in a worker thread: NCCL's teardown joins its abort thread for up
        to 5 s, which on the event loop froze every health watch and the control socket."""
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self.sender.close)


async def wait_port_released(host: str, port: int, timeout_s: float) -> None:
    """Return once a group can form on the fixed `port`: this process's last group on it is
    released, then nothing else listens on it. The release ends at once, or, when a member died
    mid-sync, once the operation stuck on it ran out (gloo's `timeout_s` after it began, which
    was before this call): it is waited for that long plus `CONTROL_TIMEOUT_S`. Any other holder
    is waited for `timeout_s`. Raises `WeightTransferError` naming `bridge.port`."""
    try:
        await wait_until(
            lambda: not releasing(port),
            timeout_s + CONTROL_TIMEOUT_S,
            lambda: f"this process's last weight group on port {port} (an operation stuck on a member that died; "
            f"gloo's timeout is {timeout_s:g} s)",
        )
        await wait_port_free(host, port, timeout_s)
    except ReleaseTimeoutError as exc:
        raise WeightTransferError(f"bridge.port: {exc}") from None


@asynccontextmanager
async def open_weight_group(clients: Sequence[EngineWeightClient], cfg: TransferConfig | None = None) -> AsyncIterator[WeightGroup]:
    """Form one weight-transfer group over `clients`' engines (opening the clients), yield it,
    and release both sides at exit. The engines must run the backend `cfg.transport` names."""
    cfg = cfg or TransferConfig()
    if cfg.port:
        await wait_port_released(cfg.host, cfg.port, cfg.timeout_s)
    async with EngineFanout(clients) as fanout:
        sizes = await fanout.world_sizes()
        offsets = rank_offsets(sizes)
        sender = make_sender(cfg, 1 + sum(sizes))
        group = WeightGroup(fanout, sender, offsets, cfg)
        try:
            await group.form()
            yield group
        finally:
            with anyio.CancelScope(shield=True):
                await group.shutdown()


def iter_state(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> Iterable[tuple[str, torch.Tensor]]:
    """The named tensors of an HF model that vLLM's `load_weights` takes: its state dict (or
    `state`, the whole model's tensors gathered elsewhere: sharded trainer ranks) without the
    duplicated tied output head (vLLM's loader skips `lm_head.weight` when tied)."""
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    for name, tensor in (model.state_dict() if state is None else state).items():
        if tied and name == "lm_head.weight":
            continue
        yield name, tensor
