"""What the LoRA modes share (grpod/bridges/adapters.py): adapter names per version and vLLM's rank."""

from __future__ import annotations

import pytest

from grpod.bridges.adapters import (
    VLLM_MAX_LORA_RANKS,
    Adapter,
    LoraRankUnsupported,
    adapter_name,
    max_lora_rank,
)
from grpod.weights.versions import VersionedDirs


@pytest.mark.parametrize(("rank", "expected"), [(1, 1), (2, 8), (8, 8), (9, 16), (16, 16), (300, 320), (512, 512)])
def test_max_lora_rank_is_the_smallest_vllm_accepts(rank, expected):
    assert max_lora_rank(rank) == expected
    assert expected in VLLM_MAX_LORA_RANKS


def test_a_rank_vllm_cannot_serve_is_an_actionable_error():
    with pytest.raises(LoraRankUnsupported, match=r"train.lora_config.rank = 600 exceeds .*512"):
        max_lora_rank(600)


def test_names_and_directories_are_per_version(tmp_path):
    store = VersionedDirs(tmp_path / "adapters")
    assert store.path_for(7) == tmp_path / "adapters" / "v000007"
    assert adapter_name(7) == "policy-v7" == Adapter(7, store.path_for(7)).name
    assert adapter_name(7) != adapter_name(70)
    assert Adapter(3, store.path_for(3)).as_dict() == {"name": "policy-v3", "version": 3, "path": str(store.path_for(3))}
