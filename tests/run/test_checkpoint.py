"""Checkpoints survive SIGKILL at any point of a write, and damaged ones are skipped, not loaded."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import structlog
import torch

from grpod.run.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    ResumeError,
    begin_line,
    clean_stale_temp,
    latest_checkpoint,
    list_checkpoints,
    load_json,
    load_tensors_state,
    resolve_resume,
    resume_from,
    save_json,
    save_tensors_state,
    verify_checkpoint,
    write_checkpoint,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _populate_bytes(payload: bytes, name: str = "model.bin"):
    def populate(directory: Path) -> None:
        (directory / name).write_bytes(payload)
        save_json(directory, "trainer.json", {"payload_len": len(payload)})

    return populate


def _write(root: Path, step: int, keep_last: int = 10, payload: bytes | None = None) -> Path:
    payload = payload if payload is not None else f"weights of step {step}".encode() * 100
    meta = {"policy_version": step, "config_hash": "abc123"}
    return write_checkpoint(root, step, _populate_bytes(payload), meta, keep_last=keep_last)


def _hidden_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_round_trip_restores_files_json_and_optimizer_state(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    weights = os.urandom(50_000)

    def populate(directory: Path) -> None:
        (directory / "model").mkdir()
        (directory / "model" / "weights.bin").write_bytes(weights)
        save_json(directory, "trainer.json", {"step": 7, "lr": 1e-3})
        save_tensors_state(directory, "optimizer.pt", optimizer.state_dict())

    path = write_checkpoint(tmp_path, 7, populate, {"policy_version": 3, "config_hash": "c0ffee"}, keep_last=2)

    assert path == tmp_path / "step-000007"
    assert _hidden_dirs(tmp_path) == []
    info = verify_checkpoint(path)
    assert info.step == 7
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 1
    assert manifest["policy_version"] == 3 and manifest["config_hash"] == "c0ffee"
    assert datetime.fromisoformat(manifest["created"]).utcoffset().total_seconds() == 0
    assert manifest["meta"] == {"policy_version": 3, "config_hash": "c0ffee"}
    assert sorted(f["path"] for f in manifest["files"]) == ["model/weights.bin", "optimizer.pt", "trainer.json"]
    sizes = {f["path"]: f["size"] for f in manifest["files"]}
    assert sizes["model/weights.bin"] == len(weights)

    assert (path / "model" / "weights.bin").read_bytes() == weights
    assert load_json(path, "trainer.json") == {"step": 7, "lr": 1e-3}
    restored = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1e-3)
    restored.load_state_dict(load_tensors_state(path, "optimizer.pt"))
    saved_state = optimizer.state_dict()["state"]
    for key, value in restored.state_dict()["state"].items():
        assert torch.equal(value["exp_avg"], saved_state[key]["exp_avg"])
        assert torch.equal(value["exp_avg_sq"], saved_state[key]["exp_avg_sq"])

    assert [c.step for c in list_checkpoints(tmp_path)] == [7]
    assert latest_checkpoint(tmp_path).path == path


def test_a_view_is_saved_without_its_whole_storage(tmp_path: Path) -> None:
    fused = torch.zeros(1_000_000)
    view = fused[10:20]
    view += 1.5
    path = save_tensors_state(tmp_path, "state.pt", {"state": {0: {"exp_avg": view}}, "step": 3})
    assert path.stat().st_size < 10_000
    loaded = load_tensors_state(tmp_path, "state.pt")
    assert torch.equal(loaded["state"][0]["exp_avg"], torch.full((10,), 1.5))
    assert loaded["step"] == 3


class _NotPlainState:
    pass


def test_load_tensors_state_refuses_arbitrary_pickles(tmp_path: Path) -> None:
    torch.save({"obj": _NotPlainState()}, tmp_path / "evil.pt")
    with pytest.raises(CorruptCheckpointError, match="evil.pt"):
        load_tensors_state(tmp_path, "evil.pt")
    with pytest.raises(CheckpointError, match="missing"):
        load_tensors_state(tmp_path, "absent.pt")


def test_failing_populate_leaves_nothing_behind(tmp_path: Path) -> None:
    _write(tmp_path, 1)

    def populate(directory: Path) -> None:
        (directory / "half.bin").write_bytes(b"x" * 100)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_checkpoint(tmp_path, 2, populate, {}, keep_last=3)
    assert _hidden_dirs(tmp_path) == []
    assert [c.step for c in list_checkpoints(tmp_path)] == [1]


def test_populate_may_not_write_the_manifest(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="reserved"):
        write_checkpoint(tmp_path, 1, lambda d: (d / "manifest.json").write_text("{}"), {}, keep_last=1)
    assert list(tmp_path.iterdir()) == []


def test_flipped_byte_is_skipped_with_a_warning_and_the_previous_is_used(tmp_path: Path) -> None:
    _write(tmp_path, 1)
    newest = _write(tmp_path, 2)
    blob = bytearray((newest / "model.bin").read_bytes())
    blob[len(blob) // 2] ^= 0x01
    (newest / "model.bin").write_bytes(bytes(blob))

    with pytest.raises(CorruptCheckpointError, match="model.bin.*sha256"):
        verify_checkpoint(newest)
    with structlog.testing.capture_logs() as logs:
        latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.step == 1
    skipped = [e for e in logs if e["event"] == "checkpoint_skipped"]
    assert len(skipped) == 1
    assert skipped[0]["path"] == str(newest) and "model.bin" in skipped[0]["reason"]
    assert skipped[0]["log_level"] == "warning"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / "model.bin").unlink(), "model.bin: listed in the manifest but missing"),
        (lambda p: (p / "model.bin").write_bytes(b"short"), "model.bin: size 5 bytes"),
        (lambda p: (p / "manifest.json").unlink(), "manifest.json is missing"),
        (lambda p: (p / "manifest.json").write_text('{"format": 1, "step": '), "not valid JSON"),
        (lambda p: (p / "manifest.json").write_text('{"format": 99}'), "format 99"),
        (lambda p: (p / "manifest.json").write_text(
            json.dumps({**json.loads((p / "manifest.json").read_text()), "files": []})), "'files' lists no file"),
    ],
    ids=["missing-file", "size", "no-manifest", "bad-json", "unknown-format", "no-files"],
)
def test_each_kind_of_damage_is_named_and_skipped(tmp_path: Path, damage, message: str) -> None:
    _write(tmp_path, 1)
    newest = _write(tmp_path, 2)
    damage(newest)
    with pytest.raises(CorruptCheckpointError, match=message):
        verify_checkpoint(newest)
    assert latest_checkpoint(tmp_path).step == 1


def test_only_damaged_checkpoints_means_none(tmp_path: Path) -> None:
    only = _write(tmp_path, 1)
    (only / "model.bin").write_bytes(b"")
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "does-not-exist") is None


def test_retention_keeps_the_newest_and_spares_other_writers(tmp_path: Path) -> None:
    concurrent = tmp_path / ".tmp-step-000099-deadbeef"
    concurrent.mkdir(parents=True)
    (concurrent / "partial.bin").write_bytes(b"in progress")
    for step in range(1, 6):
        _write(tmp_path, step, keep_last=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [4, 5]
    assert concurrent.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step-000099-deadbeef", "step-000004", "step-000005"]


def test_the_checkpoint_just_written_is_never_pruned(tmp_path: Path) -> None:
    for step in (10, 11, 12):
        _write(tmp_path, step, keep_last=2)
    written = _write(tmp_path, 3, keep_last=2)
    assert written.exists()
    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 11, 12]


def test_same_step_is_replaced_safely(tmp_path: Path) -> None:
    _write(tmp_path, 5, payload=b"first")
    path = _write(tmp_path, 5, payload=b"second")
    assert (path / "model.bin").read_bytes() == b"second"
    assert verify_checkpoint(path).step == 5
    assert _hidden_dirs(tmp_path) == []


def test_clean_stale_temp_removes_leftovers_and_restores_an_interrupted_replace(tmp_path: Path) -> None:
    _write(tmp_path, 1)
    replaced = _write(tmp_path, 2, payload=b"old step 2")
    # The state a kill leaves between the two renames of a same-step replace.
    os.rename(replaced, tmp_path / ".old-step-000002-0a1b2c3d")
    (tmp_path / ".tmp-step-000002-99999999").mkdir()
    (tmp_path / ".del-step-000000-12345678").mkdir()
    assert latest_checkpoint(tmp_path).step == 1

    removed = clean_stale_temp(tmp_path)

    assert sorted(p.name for p in removed) == [".del-step-000000-12345678", ".tmp-step-000002-99999999"]
    assert _hidden_dirs(tmp_path) == []
    latest = latest_checkpoint(tmp_path)
    assert latest.step == 2 and (latest.path / "model.bin").read_bytes() == b"old step 2"


def test_resolve_resume_modes(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    assert resolve_resume(root, "auto") is None
    first = _write(root, 1)
    _write(root, 2)
    assert resolve_resume(root, "never") is None
    assert resolve_resume(root, "auto").step == 2
    assert resolve_resume(root, str(first)).step == 1

    with pytest.raises(ResumeError, match="no such path.*'auto', 'never'"):
        resolve_resume(root, str(tmp_path / "nope"))
    with pytest.raises(ResumeError, match="checkpoint root"):
        resolve_resume(root, str(root))
    (first / "model.bin").write_bytes(b"tampered")
    with pytest.raises(ResumeError, match="model.bin"):
        resolve_resume(root, str(first))


# --- real processes killed with SIGKILL while they write ---------------------------------------

_SLOW_WRITER = """
import os, sys, time
from pathlib import Path
from grpod.run.checkpoint import write_checkpoint

def populate(directory):
    for k in range(400):
        (directory / f"shard-{k:03d}.bin").write_bytes(os.urandom(32 * 1024))
        time.sleep(0.01)

write_checkpoint(Path(sys.argv[1]), 2, populate, {"policy_version": 2}, keep_last=3)
print("finished", flush=True)
"""

_LOOPING_WRITER = """
import os, random, sys
from pathlib import Path
from grpod.run.checkpoint import write_checkpoint

root, step, seed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)

def populate(directory):
    (directory / "sub").mkdir()
    for name in ("model.bin", "sub/optimizer.bin", "trainer.json"):
        (directory / name).write_bytes(os.urandom(rng.randint(0, 300_000)))

while True:
    # Every third write replaces the checkpoint of the step before (a same-step replace).
    target = step - 1 if step % 3 == 0 and step > 1 else step
    write_checkpoint(root, target, populate, {"policy_version": target}, keep_last=2)
    print(f"written {target}", flush=True)
    step += 1
"""


@pytest.fixture
def spawn():
    """Start python child processes; kill any still running at the end."""
    children: list[subprocess.Popen] = []

    def start(code: str, *args: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )
        children.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            proc.stdout.close()
            proc.stderr.close()


def _kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL


def _wait_for_line(proc: subprocess.Popen, prefix: str, timeout_s: float) -> str:
    """The child's first stdout line starting with prefix (structlog also prints there)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"child {proc.pid} printed no {prefix!r} line within {timeout_s}s")
        line = proc.stdout.readline().decode()
        if not line:
            status = proc.wait(timeout=10)
            raise AssertionError(f"child {proc.pid} exited early ({status}): {proc.stderr.read().decode()}")
        if line.startswith(prefix):
            return line


def test_sigkill_during_a_write_leaves_the_previous_checkpoint_usable(tmp_path: Path, spawn) -> None:
    previous = _write(tmp_path, 1)
    proc = spawn(_SLOW_WRITER, str(tmp_path))

    deadline = time.monotonic() + 60
    while True:
        temps = list(tmp_path.glob(".tmp-step-000002-*"))
        if temps and len(list(temps[0].iterdir())) >= 30:
            break
        assert proc.poll() is None, f"writer exited before it was killed: {proc.stderr.read().decode()}"
        assert time.monotonic() < deadline, "writer did not get 30 shards into its checkpoint within 60 s"
        time.sleep(0.02)
    _kill(proc)

    assert not (tmp_path / "step-000002").exists()
    assert [c.step for c in list_checkpoints(tmp_path)] == [1]
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.path == previous
    assert resolve_resume(tmp_path, "auto").step == 1
    assert clean_stale_temp(tmp_path) == temps
    assert _hidden_dirs(tmp_path) == []


def test_repeated_sigkill_at_random_instants_never_exposes_a_broken_checkpoint(tmp_path: Path, spawn) -> None:
    chooser = random.Random(20240601)
    step = 1
    for round_no in range(5):
        clean_stale_temp(tmp_path)
        proc = spawn(_LOOPING_WRITER, str(tmp_path), str(step), str(round_no))
        _wait_for_line(proc, "written", timeout_s=60)
        time.sleep(chooser.uniform(0.0, 0.15))
        _kill(proc)

        visible = sorted(tmp_path.glob("step-*"))
        assert visible, "at least one checkpoint was completed before the kill"
        for path in visible:
            verify_checkpoint(path)
        latest = latest_checkpoint(tmp_path)
        assert latest is not None
        step = latest.step + 1
    clean_stale_temp(tmp_path)
    assert _hidden_dirs(tmp_path) == []
    assert all(verify_checkpoint(p) for p in tmp_path.glob("step-*"))


def test_every_checkpoint_corrupt_refuses_auto_resume_naming_each(tmp_path: Path) -> None:
    """Issue #30, 9: no silent fresh start over a run whose checkpoints are all damaged."""
    from grpod.run.checkpoint import NoUsableCheckpoint

    first, second = _write(tmp_path, 1), _write(tmp_path, 2)
    (first / "model.bin").write_bytes(b"x")
    (second / "manifest.json").unlink()
    with pytest.raises(NoUsableCheckpoint) as caught:
        resolve_resume(tmp_path, "auto")
    message = str(caught.value)
    assert "step-000001: " in message and "model.bin: size 1 bytes" in message
    assert "step-000002: " in message and "manifest.json is missing" in message
    assert 'run.resume = "never"' in message
    assert resolve_resume(tmp_path, "never") is None, "an explicit fresh start stays possible"
    assert resolve_resume(tmp_path / "empty", "auto") is None, "no checkpoint at all: a fresh run"


def _full_filesystem(monkeypatch, free: int) -> None:
    real = os.statvfs

    class Full:
        def __init__(self, st):
            self.f_frsize, self.f_blocks, self.f_bavail = 4096, st.f_blocks, free // 4096
            self.f_flag = st.f_flag

    monkeypatch.setattr(os, "statvfs", lambda path: Full(real(path)))


@pytest.mark.parametrize("error", ["torch", "enospc"])
def test_a_write_out_of_space_is_named_and_leaves_nothing(tmp_path: Path, monkeypatch, error) -> None:
    """Issue #30, 8: torch's writer reports a full disk as `unexpected pos` with no errno; a plain
    write as ENOSPC. Either is a CheckpointDiskFull naming the filesystem and the file; the older
    checkpoint stays. (The filesystem's free space is faked here; the fault case fills a tmpfs.)"""
    import errno

    from grpod.run.checkpoint import CheckpointDiskFull

    _write(tmp_path, 1)

    def populate(directory: Path) -> None:
        (directory / "model.bin").write_bytes(b"weights")
        (directory / "trainer_state.pt").write_bytes(b"partial")
        if error == "torch":
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 64")
        raise OSError(errno.ENOSPC, "No space left on device")

    _full_filesystem(monkeypatch, free=4096 if error == "torch" else 10 << 30)
    with pytest.raises(CheckpointDiskFull) as caught:
        write_checkpoint(tmp_path, 2, populate, {}, keep_last=3)
    message = str(caught.value)
    assert message.startswith("no space left on /") and "step-000002/trainer_state.pt" in message, message
    assert caught.value.path == tmp_path / "step-000002" / "trainer_state.pt"
    assert [c.step for c in list_checkpoints(tmp_path)] == [1] and _hidden_dirs(tmp_path) == []


@pytest.mark.parametrize("where", ["mkdir", "torch"])
def test_a_write_on_a_read_only_filesystem_is_named_whichever_call_failed(tmp_path: Path, monkeypatch, where) -> None:
    """A filesystem remounted read-only fails the write wherever it is: EROFS from making the
    temporary directory, or torch's `open file failed with strerror` (a RuntimeError, no errno)
    from a file inside it. Either is a CheckpointNotWritten naming the filesystem and the file,
    not one of two raw errors; the older checkpoint stays. (The mount's flag is faked here; the
    fault case remounts a tmpfs.)"""
    import errno

    from grpod.run.checkpoint import CheckpointDiskFull, CheckpointNotWritten

    _write(tmp_path, 1)
    real_statvfs, real_mkdir = os.statvfs, Path.mkdir

    class ReadOnly:
        def __init__(self, st):
            self.f_frsize, self.f_blocks, self.f_bavail = st.f_frsize, st.f_blocks, st.f_bavail
            self.f_flag = st.f_flag | os.ST_RDONLY

    def populate(directory: Path) -> None:
        (directory / "model.bin").write_bytes(b"weights")
        monkeypatch.setattr(os, "statvfs", lambda path: ReadOnly(real_statvfs(path)))
        raise RuntimeError("[enforce fail at inline_container.cc:747] . open file failed with strerror: "
                           "Read-only file system")

    def mkdir(self, *args, **kwargs):
        if self.name.startswith(".tmp-"):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    if where == "mkdir":
        monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(CheckpointNotWritten) as caught:
        write_checkpoint(tmp_path, 2, populate, {}, keep_last=3)
    assert not isinstance(caught.value, CheckpointDiskFull)
    message = str(caught.value)
    assert message.startswith("read-only file system at /"), message
    shown = "step-000002/model.bin" if where == "torch" else "step-000002:"
    assert shown in message and "the checkpoint was not written (older ones are intact)" in message, message
    assert [c.step for c in list_checkpoints(tmp_path)] == [1]


def test_a_failure_with_space_left_is_not_called_disk_full(tmp_path: Path, monkeypatch) -> None:
    def populate(directory: Path) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")

    _full_filesystem(monkeypatch, free=10 << 30)
    with pytest.raises(RuntimeError, match="unexpected pos"):
        write_checkpoint(tmp_path, 2, populate, {}, keep_last=3)


def test_a_checkpoint_moved_to_another_disk_behind_a_link_is_pruned_by_its_link(tmp_path: Path) -> None:
    """An operator moved step 1 elsewhere and left a symbolic link: pruning it (keep_last = 1)
    removes the link, never what it points at, and the run goes on; so does a start that finds
    a link left half-pruned."""
    root, elsewhere = tmp_path / "ckpt", tmp_path / "other-disk"
    moved = _write(root, 1)
    elsewhere.mkdir()
    os.rename(moved, elsewhere / moved.name)
    moved.symlink_to(elsewhere / moved.name, target_is_directory=True)
    assert [info.step for info in list_checkpoints(root)] == [1]
    _write(root, 2, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-000002"]
    assert verify_checkpoint(elsewhere / moved.name), "the moved checkpoint itself is left alone"
    # A prune killed between its rename and its delete left a hidden link: the next start tidies it.
    (root / ".del-step-000001-0badf00d").symlink_to(elsewhere / moved.name, target_is_directory=True)
    assert clean_stale_temp(root) == [root / ".del-step-000001-0badf00d"]
    assert (elsewhere / moved.name).is_dir()


def test_a_fresh_start_moves_the_run_it_leaves_out_of_view(tmp_path: Path) -> None:
    """run.resume = "never" on a run directory with checkpoints of steps 14-17: they go to
    superseded/, so the new line's checkpoints are the newest (a later "auto" start resumes them,
    not step 17) and rotation prunes among them only."""
    root = tmp_path / "ckpt"
    for step in (14, 16, 17):
        _write(root, step)
    info, new_line = resume_from(root, "never")
    assert info is None and new_line
    moved = begin_line(root, "never", info)
    assert [p.name for p in moved] == ["step-000014", "step-000016", "step-000017"]
    assert all(verify_checkpoint(p) for p in moved), "kept whole, out of view"
    for step in (2, 4, 5):
        _write(root, step, keep_last=2)
    assert [i.step for i in list_checkpoints(root)] == [4, 5]
    assert resume_from(root, "auto") == (latest_checkpoint(root), False) and latest_checkpoint(root).step == 5


def test_a_start_from_an_older_checkpoint_is_applied_once(tmp_path: Path) -> None:
    """run.resume = PATH (step 6 of this run, 8 and 10 after it): 8 and 10 are moved out of view;
    once the new line has checkpoints, a restart with the same setting resumes the line's newest,
    also after rotation pruned PATH itself."""
    root = tmp_path / "ckpt"
    for step in (6, 8, 10):
        _write(root, step)
    path = str(root / "step-000006")
    info, new_line = resume_from(root, path)
    assert info.step == 6 and new_line
    assert [p.name for p in begin_line(root, path, info)] == ["step-000008", "step-000010"]
    # Restarted before the new line wrote anything: PATH again.
    again, new_line = resume_from(root, path)
    assert again.step == 6 and new_line
    begin_line(root, path, again)
    for step in (7, 9):
        _write(root, step, keep_last=1)
    assert [i.step for i in list_checkpoints(root)] == [9], "rotation pruned PATH"
    continued, new_line = resume_from(root, path)
    assert continued.step == 9 and not new_line
    # Another PATH is a new instruction: applied, the newer checkpoints out of view again.
    other = _write(tmp_path / "elsewhere", 3)
    info, new_line = resume_from(root, str(other))
    assert info.step == 3 and new_line
    assert [p.name for p in begin_line(root, str(other), info)] == ["step-000009"]
