"""The gloo weight-transfer wire format, shared by the trainer (rank 0) and the vLLM engines.

What travels over HTTP (vLLM's `/init_weight_transfer_engine` and `/update_weights` bodies) is
`GlooInitInfo` / `GlooUpdateInfo` as plain dicts; what travels over gloo is one uint8 tensor per
chunk, broadcast from rank 0, holding the chunk's tensors back to back (vLLM's `pack_tensors`
layout, read back with `unpack_tensor`).

The chunk boundaries are decided once, by the trainer, and sent in the update info
(`chunk_counts`): the engine sizes each receive buffer from them and never re-derives the
packing rule. `plan_chunks` is that rule, the same greedy one as vLLM's `pack_tensors` (a chunk
ends with the tensor that takes it past `chunk_bytes`), so the trainer can pack with vLLM's
helper and check that it cut where the plan said.

No import side effects, no vLLM state: both sides import this module.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

GLOO_BACKEND = "gloo"
# 64 MiB chunks: large enough that per-chunk overhead (one gloo round, one load_weights call)
# vanishes, small enough that the trainer's packed copy and each engine's receive buffers
# (`inflight_chunks` of them) stay small next to the model.
DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 120.0
# Chunks in flight per side: receive (or pack) chunk k+1 while chunk k loads (or travels).
DEFAULT_INFLIGHT_CHUNKS = 2


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> "float32", the spelling vLLM's weight-transfer payloads use."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return dtype


def tensor_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def plan_chunks(nbytes: Sequence[int], chunk_bytes: int) -> list[int]:
    """How many consecutive tensors each chunk holds, for tensors of `nbytes` bytes each.

    Greedy, as vLLM's `pack_tensors`: tensors join the current chunk until its size exceeds
    `chunk_bytes`; the tensor that crosses the bound is the chunk's last. A tensor larger than
    `chunk_bytes` is a chunk of its own (or ends one). No tensors, no chunks.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    counts: list[int] = []
    count = size = 0
    for n in nbytes:
        count += 1
        size += n
        if size > chunk_bytes:
            counts.append(count)
            count = size = 0
    if count:
        counts.append(count)
    return counts


@dataclass(kw_only=True)
class GlooInitInfo(WeightTransferInitInfo):
    """The body of `/init_weight_transfer_engine` for one engine (`init_info`).

    `master_address`/`master_port`: where rank 0 (the trainer) listens; the engine must be given
    exactly the host string rank 0 bound, because torch prefixes the group's store keys with
    `tcp://host:port`. `rank_offset`: the group rank of this engine's first worker (the trainer
    is 0); a worker's rank is `dp_index * world_size + rank + rank_offset`, as in vLLM's NCCL
    engine. `world_size`: the whole group, 1 + every engine's workers. `timeout_s` bounds forming
    the group and every collective on the engine's side.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    inflight_chunks: int = DEFAULT_INFLIGHT_CHUNKS

    def __post_init__(self) -> None:
        if not 1 <= self.rank_offset < self.world_size:
            raise ValueError(
                f"rank_offset {self.rank_offset} must be in [1, world_size = {self.world_size}): "
                "rank 0 is the trainer"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.inflight_chunks < 1:
            raise ValueError(f"inflight_chunks must be >= 1, got {self.inflight_chunks}")


@dataclass(frozen=True)
class ChunkEntry:
    name: str
    shape: list[int]
    dtype: torch.dtype
    nbytes: int


@dataclass(kw_only=True)
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """The body of one `/update_weights` (`update_info`): every tensor of the update, in the order
    rank 0 broadcasts them, and how many of them each chunk holds.

    One call carries whole layers: the engine finalises its reload at the end of each call (so
    that no parameter outlives the call on the meta device), and a layer split across two calls
    would be processed half-loaded in the first. Sending the whole model in one call, as
    `WeightGroup.sync` does, satisfies it.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    chunk_counts: list[int]

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(
                f"names, dtype_names and shapes must have one entry per tensor: got {n}, "
                f"{len(self.dtype_names)} and {len(self.shapes)}"
            )
        if any(c < 1 for c in self.chunk_counts) or sum(self.chunk_counts) != n:
            raise ValueError(
                f"chunk_counts {self.chunk_counts} must be positive and add up to the {n} tensors"
            )
        for name in self.dtype_names:
            dtype_from_name(name)

    @classmethod
    def plan(cls, metadata: Sequence[tuple[str, torch.dtype, Sequence[int]]], chunk_bytes: int) -> GlooUpdateInfo:
        """The update info for tensors described by `(name, dtype, shape)`, cut into chunks of
        about `chunk_bytes` (`plan_chunks`)."""
        sizes = [tensor_nbytes(shape, dtype) for _, dtype, shape in metadata]
        return cls(
            names=[name for name, _, _ in metadata],
            dtype_names=[dtype_name(dtype) for _, dtype, _ in metadata],
            shapes=[list(shape) for _, _, shape in metadata],
            chunk_counts=plan_chunks(sizes, chunk_bytes),
        )

    def chunks(self) -> Iterator[list[ChunkEntry]]:
        start = 0
        for count in self.chunk_counts:
            yield [
                ChunkEntry(name, list(shape), dtype, tensor_nbytes(shape, dtype))
                for name, shape, dtype in zip(
                    self.names[start : start + count],
                    self.shapes[start : start + count],
                    (dtype_from_name(d) for d in self.dtype_names[start : start + count]),
                    strict=True,
                )
            ]
            start += count

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for chunk in self.chunks() for e in chunk)
