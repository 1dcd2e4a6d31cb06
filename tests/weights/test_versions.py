"""Versioned directories (grpod/weights/versions.py): atomic writes, adoption, pruning — what the
bridges publish weights (`none`) and adapters (the LoRA modes) through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grpod.config import GrpodConfig
from grpod.models.tiny import build_model, save_model
from grpod.training.trainer import Trainer, build_trainer
from grpod.weights.versions import VersionedDirs, version_dir_name


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
    return build_trainer(cfg)


def make_versions(store: VersionedDirs, versions) -> None:
    for v in versions:
        store.path_for(v).mkdir(parents=True)


def test_one_name_per_version():
    assert version_dir_name(7) == "v000007"
    assert VersionedDirs(Path("/r")).path_for(7) == Path("/r/v000007")
    assert version_dir_name(1234567) == "v1234567"


def test_write_publishes_a_complete_peft_adapter(tmp_path, lora_trainer):
    store = VersionedDirs(tmp_path / "adapters")
    path = store.write(0, lora_trainer.save_weights)
    assert path == store.path_for(0)
    assert {p.name for p in path.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((path / "adapter_config.json").read_text())["r"] == 4
    assert store.versions() == [0]
    assert [p.name for p in store.root.iterdir()] == ["v000000"], "no partial directory may remain"


def test_rewriting_a_version_replaces_its_directory(tmp_path, lora_trainer):
    store = VersionedDirs(tmp_path / "adapters")
    make_versions(store, [2])
    (store.path_for(2) / "stale-file").write_text("left by a failed sync")
    store.write(2, lora_trainer.save_weights)
    assert not (store.path_for(2) / "stale-file").exists()
    assert (store.path_for(2) / "adapter_model.safetensors").exists()


class CrashingSave:
    """A save that dies half-way (disk full, killed thread): a real trainer cannot on demand."""

    def save_weights(self, out):
        out.mkdir(parents=True)
        (out / "adapter_config.json").write_text("{}")
        raise OSError(28, "No space left on device")


def test_a_failed_write_publishes_nothing_and_keeps_the_old_version(tmp_path, lora_trainer):
    store = VersionedDirs(tmp_path / "adapters")
    store.write(1, lora_trainer.save_weights)
    before = (store.path_for(1) / "adapter_model.safetensors").read_bytes()
    with pytest.raises(OSError, match="No space left"):
        store.write(2, CrashingSave().save_weights)
    with pytest.raises(OSError, match="No space left"):
        store.write(1, CrashingSave().save_weights)
    assert store.versions() == [1]
    assert [p.name for p in store.root.iterdir()] == ["v000001"]
    assert (store.path_for(1) / "adapter_model.safetensors").read_bytes() == before


def test_prune_keeps_the_newest_versions_up_to_the_current_one(tmp_path):
    store = VersionedDirs(tmp_path / "adapters")
    make_versions(store, range(6))
    assert store.prune(current=5, keep=3) == [0, 1, 2]
    assert store.versions() == [3, 4, 5]


def test_prune_always_keeps_the_previous_version(tmp_path):
    store = VersionedDirs(tmp_path / "adapters")
    make_versions(store, range(4))
    store.prune(current=3, keep=1)
    assert store.versions() == [2, 3], "requests in flight on the previous adapter may need its directory"


def test_prune_removes_versions_after_the_current_one_and_partial_writes(tmp_path):
    store = VersionedDirs(tmp_path / "adapters")
    make_versions(store, [4, 5, 6, 7])
    (store.root / ".partial-v000008").mkdir()
    (store.root / "notes.txt").write_text("not an adapter")
    assert store.prune(current=5, keep=3) == [6, 7]
    assert store.versions() == [4, 5]
    assert sorted(p.name for p in store.root.iterdir()) == ["notes.txt", "v000004", "v000005"]


def test_prune_never_removes_a_protected_directory(tmp_path):
    store = VersionedDirs(tmp_path / "weights")
    make_versions(store, range(5))
    assert store.prune(current=4, keep=2, protect=[store.path_for(0)]) == [1, 2]
    assert store.versions() == [0, 3, 4], "an engine launched on v0 may need it to relaunch"


def test_adopt_publishes_another_directorys_files_without_copying(tmp_path):
    source = tmp_path / "checkpoint" / "model"
    (source / "sub").mkdir(parents=True)
    (source / "model.safetensors").write_bytes(b"w" * 1000)
    (source / "sub" / "x.json").write_text("{}")
    store = VersionedDirs(tmp_path / "weights")
    path = store.adopt(3, source)
    assert path == store.path_for(3)
    assert (path / "model.safetensors").read_bytes() == b"w" * 1000 and (path / "sub" / "x.json").exists()
    assert (path / "model.safetensors").stat().st_ino == (source / "model.safetensors").stat().st_ino, "hard-linked"


def test_prune_on_a_missing_root_is_a_no_op(tmp_path):
    assert VersionedDirs(tmp_path / "nothing").prune(current=0, keep=3) == []


def test_the_written_adapter_is_the_trainers(tmp_path, lora_trainer):
    """What lands on disk is the trainer's current adapter, not its initial one."""
    from safetensors.torch import load_file

    store = VersionedDirs(tmp_path / "adapters")
    lora_b = next(p for n, p in lora_trainer.model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b.fill_(0.125)
    try:
        saved = load_file(store.write(1, lora_trainer.save_weights) / "adapter_model.safetensors")
    finally:
        with torch.no_grad():
            lora_b.zero_()
    b_tensors = [t for k, t in saved.items() if "lora_B" in k]
    assert b_tensors and any(torch.all(t == 0.125) for t in b_tensors)


def test_a_write_the_filesystem_refused_is_named_whatever_the_writer_raised(tmp_path: Path, monkeypatch) -> None:
    """A filesystem remounted read-only between two files of a version: safetensors raises its own
    SafetensorError (no errno, not an OSError), which the bridge took for a broken bridge and the
    run ended. It is a WeightsNotWritten (an OSError: a sync not saved) naming the filesystem and
    the file; nothing partial is left. (The mount's flag is faked here; the fault case remounts a
    tmpfs.)"""
    import os

    from safetensors.torch import save_file

    from grpod.weights.versions import WeightsNotWritten

    versions = VersionedDirs(tmp_path / "weights")
    real = os.statvfs

    class ReadOnly:
        def __init__(self, st):
            self.f_frsize, self.f_blocks, self.f_bavail = st.f_frsize, st.f_blocks, st.f_bavail
            self.f_flag = st.f_flag | os.ST_RDONLY

    remount = [True]

    def writer(directory: Path) -> None:
        directory.mkdir()
        (directory / "config.json").write_text("{}")
        if remount[0]:
            monkeypatch.setattr(os, "statvfs", lambda path: ReadOnly(real(path)))
        save_file({"w": torch.zeros(2)}, str(directory / "missing" / "model.safetensors"))  # SafetensorError

    with pytest.raises(WeightsNotWritten) as caught:
        versions.write(3, writer)
    assert isinstance(caught.value, OSError) and type(caught.value.__cause__).__name__ == "SafetensorError"
    message = str(caught.value)
    assert message.startswith("read-only file system at /"), message
    assert f"writing {versions.path_for(3) / 'config.json'}: SafetensorError: " in message, message
    assert list((tmp_path / "weights").iterdir()) == [], "nothing partial left"
    monkeypatch.setattr(os, "statvfs", real)
    remount[0] = False
    with pytest.raises(Exception) as other:  # a writer's own failure on a writable filesystem stays itself
        versions.write(4, writer)
    assert not isinstance(other.value, WeightsNotWritten)
