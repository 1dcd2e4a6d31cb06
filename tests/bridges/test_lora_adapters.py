"""Versioned adapter directories (grpod/bridges/adapters.py): naming, atomic writes, pruning, rank."""

from __future__ import annotations

import json

import pytest
import torch

from grpod.bridges.adapters import (
    VLLM_MAX_LORA_RANKS,
    Adapter,
    AdapterStore,
    LoraRankUnsupported,
    adapter_name,
    max_lora_rank,
)
from grpod.config import GrpodConfig
from grpod.models.tiny import build_model, save_model
from grpod.training.trainer import Trainer


@pytest.fixture(scope="module")
def lora_trainer(tmp_path_factory) -> Trainer:
    root = tmp_path_factory.mktemp("lora-trainer")
    model, tokenizer = build_model(seed=0)
    save_model(model, tokenizer, root / "model")
    cfg = GrpodConfig.model_validate(
        {
            "model": {"path": str(root / "model"), "init_if_missing": False},
            "train": {"lora": True, "threads": 1, "lora_config": {"rank": 4}},
            "bridge": {"mode": "lora_only"},
        }
    )
    return Trainer(cfg, root / "model")


def make_versions(store: AdapterStore, versions) -> None:
    for v in versions:
        store.path_for(v).mkdir(parents=True)


@pytest.mark.parametrize(("rank", "expected"), [(1, 1), (2, 8), (8, 8), (9, 16), (16, 16), (300, 320), (512, 512)])
def test_max_lora_rank_is_the_smallest_vllm_accepts(rank, expected):
    assert max_lora_rank(rank) == expected
    assert expected in VLLM_MAX_LORA_RANKS


def test_a_rank_vllm_cannot_serve_is_an_actionable_error():
    with pytest.raises(LoraRankUnsupported, match=r"train.lora_config.rank = 600 exceeds .*512"):
        max_lora_rank(600)


def test_names_and_directories_are_per_version(tmp_path):
    store = AdapterStore(tmp_path / "adapters")
    assert store.path_for(7) == tmp_path / "adapters" / "v000007"
    assert adapter_name(7) == "policy-v7" == Adapter(7, store.path_for(7)).name
    assert adapter_name(7) != adapter_name(70)
    assert Adapter(3, store.path_for(3)).as_dict() == {"name": "policy-v3", "version": 3, "path": str(store.path_for(3))}


def test_write_publishes_a_complete_peft_adapter(tmp_path, lora_trainer):
    store = AdapterStore(tmp_path / "adapters")
    adapter = store.write(lora_trainer, 0)
    assert adapter == Adapter(0, store.path_for(0))
    assert {p.name for p in adapter.path.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((adapter.path / "adapter_config.json").read_text())["r"] == 4
    assert store.versions() == [0]
    assert [p.name for p in store.root.iterdir()] == ["v000000"], "no partial directory may remain"


def test_rewriting_a_version_replaces_its_directory(tmp_path, lora_trainer):
    store = AdapterStore(tmp_path / "adapters")
    make_versions(store, [2])
    (store.path_for(2) / "stale-file").write_text("left by a failed sync")
    store.write(lora_trainer, 2)
    assert not (store.path_for(2) / "stale-file").exists()
    assert (store.path_for(2) / "adapter_model.safetensors").exists()


class CrashingSave:
    """A save that dies half-way (disk full, killed thread): a real trainer cannot on demand."""

    def save_weights(self, out):
        out.mkdir(parents=True)
        (out / "adapter_config.json").write_text("{}")
        raise OSError(28, "No space left on device")


def test_a_failed_write_publishes_nothing_and_keeps_the_old_version(tmp_path, lora_trainer):
    store = AdapterStore(tmp_path / "adapters")
    store.write(lora_trainer, 1)
    before = (store.path_for(1) / "adapter_model.safetensors").read_bytes()
    with pytest.raises(OSError, match="No space left"):
        store.write(CrashingSave(), 2)
    with pytest.raises(OSError, match="No space left"):
        store.write(CrashingSave(), 1)
    assert store.versions() == [1]
    assert [p.name for p in store.root.iterdir()] == ["v000001"]
    assert (store.path_for(1) / "adapter_model.safetensors").read_bytes() == before


def test_prune_keeps_the_newest_versions_up_to_the_current_one(tmp_path):
    store = AdapterStore(tmp_path / "adapters")
    make_versions(store, range(6))
    assert store.prune(current=5, keep=3) == [0, 1, 2]
    assert store.versions() == [3, 4, 5]


def test_prune_always_keeps_the_previous_version(tmp_path):
    store = AdapterStore(tmp_path / "adapters")
    make_versions(store, range(4))
    store.prune(current=3, keep=1)
    assert store.versions() == [2, 3], "requests in flight on the previous adapter may need its directory"


def test_prune_removes_versions_after_the_current_one_and_partial_writes(tmp_path):
    store = AdapterStore(tmp_path / "adapters")
    make_versions(store, [4, 5, 6, 7])
    (store.root / ".partial-v000008").mkdir()
    (store.root / "notes.txt").write_text("not an adapter")
    assert store.prune(current=5, keep=3) == [6, 7]
    assert store.versions() == [4, 5]
    assert sorted(p.name for p in store.root.iterdir()) == ["notes.txt", "v000004", "v000005"]


def test_prune_on_a_missing_root_is_a_no_op(tmp_path):
    assert AdapterStore(tmp_path / "nothing").prune(current=0, keep=3) == []


def test_the_written_adapter_is_the_trainers(tmp_path, lora_trainer):
    """What lands on disk is the trainer's current adapter, not its initial one."""
    from safetensors.torch import load_file

    store = AdapterStore(tmp_path / "adapters")
    lora_b = next(p for n, p in lora_trainer.model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b.fill_(0.125)
    try:
        saved = load_file(store.write(lora_trainer, 1).path / "adapter_model.safetensors")
    finally:
        with torch.no_grad():
            lora_b.zero_()
    b_tensors = [t for k, t in saved.items() if "lora_B" in k]
    assert b_tensors and any(torch.all(t == 0.125) for t in b_tensors)
