"""The gloo wire format: the chunk plan agrees with vLLM's packer, and payloads are validated."""

from __future__ import annotations

from dataclasses import asdict
from itertools import islice

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

from grpod.weights.wire import GlooInitInfo, GlooUpdateInfo, dtype_from_name, dtype_name, plan_chunks


def vllm_chunking(sizes: list[int], chunk_bytes: int) -> list[int]:
    """How many tensors each chunk vLLM's `pack_tensors` cuts holds, for uint8 tensors of `sizes`."""
    stream = iter([(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)])
    counts = []
    while (chunk := pack_tensors(stream, lambda item: item[1], chunk_bytes)) is not None:
        counts.append(len(chunk.names))
    return counts


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=30), st.integers(1, 400))
def test_plan_cuts_where_vllm_packer_cuts(sizes, chunk_bytes):
    assert plan_chunks(sizes, chunk_bytes) == vllm_chunking(sizes, chunk_bytes)


def test_plan_edges():
    assert plan_chunks([], 10) == []
    assert plan_chunks([100], 10) == [1]  # larger than a chunk: a chunk of its own
    assert plan_chunks([5, 5, 1], 10) == [3]  # 10 is not past the bound; 11 is, with the third
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_chunks([1], 0)


def test_update_info_round_trips_through_vllm_unpack():
    tensors = [
        ("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("b", torch.ones(4, dtype=torch.bfloat16)),
        ("c", torch.arange(10, dtype=torch.int64)),
    ]
    info = GlooUpdateInfo.plan([(n, t.dtype, tuple(t.shape)) for n, t in tensors], chunk_bytes=20)
    assert info.chunk_counts == [1, 2]
    # The dict travels over HTTP and is rebuilt on the engine.
    info = GlooUpdateInfo(**asdict(info))
    stream = iter(tensors)
    for entries in info.chunks():
        # As the sender does: exactly this chunk's tensors, its planned size as the bound.
        chunk = pack_tensors(islice(stream, len(entries)), lambda item: item[1], sum(e.nbytes for e in entries))
        got = unpack_tensor(chunk.packed_tensor, [e.name for e in entries], [e.shape for e in entries],
                            [e.dtype for e in entries], [e.nbytes for e in entries])  # fmt: skip
        for (name, tensor), (want_name, want) in zip(got, [t for t in tensors if t[0] in chunk.names], strict=True):
            assert name == want_name and torch.equal(tensor, want)
    assert info.total_bytes == 24 + 8 + 80


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"names": ["a"], "dtype_names": [], "shapes": [[1]], "chunk_counts": [1]}, "one entry per tensor"),
        ({"names": ["a", "b"], "dtype_names": ["float32"] * 2, "shapes": [[1], [1]], "chunk_counts": [1]}, "add up"),
        ({"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]], "chunk_counts": [0, 1]}, "positive"),
        ({"names": ["a"], "dtype_names": ["float33"], "shapes": [[1]], "chunk_counts": [1]}, "not a torch dtype"),
    ],
)
def test_update_info_refuses_inconsistent_payloads(fields, message):
    with pytest.raises(ValueError, match=message):
        GlooUpdateInfo(**fields)


def test_init_info_keeps_rank_zero_for_the_trainer():
    with pytest.raises(ValueError, match="rank 0 is the trainer"):
        GlooInitInfo(master_address="127.0.0.1", master_port=1, rank_offset=0, world_size=2)
    with pytest.raises(ValueError, match="rank_offset 2"):
        GlooInitInfo(master_address="127.0.0.1", master_port=1, rank_offset=2, world_size=2)


def test_dtype_names():
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_from_name("float16") is torch.float16
    with pytest.raises(ValueError):
        dtype_from_name("Tensor")
