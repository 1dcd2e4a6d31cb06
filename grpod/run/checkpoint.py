"""Crash-safe checkpoints: a checkpoint directory is either complete or ignored.

Layout under a checkpoint root (normally `<run.dir>/checkpoints`):

    step-000042/             a complete checkpoint: its files + manifest.json (written last)
    .tmp-step-000043-<hex>/  a write in progress (or one killed mid-write); never read
    .old-step-000042-<hex>/  a checkpoint being replaced by one of the same step
    .del-step-000007-<hex>/  a checkpoint being pruned

Guarantees of `write_checkpoint`, against a kill (SIGKILL, OOM) at any instant:
- every file is written and fsynced inside a hidden temporary directory; `manifest.json`, which
  lists every file with its size and sha256, is written and fsynced last; only then is the
  directory renamed (atomic) to `step-NNNNNN` and the root fsynced;
- pruning and replacing first rename a checkpoint out of view, then delete it, so a visible
  `step-NNNNNN` is never half-deleted;
- a checkpoint of the same step is replaced by renaming the old one aside first; if the process
  dies between the two renames, `clean_stale_temp` puts the old one back.
A write that fails leaves nothing visible (its temporary directory is removed) and the newest
complete checkpoint stays the newest. When it failed because of its filesystem, it is a
`CheckpointNotWritten` naming the filesystem, the file and what to do, whichever call failed:
- full — an OSError ENOSPC, or torch's writer reporting the same as `[enforce fail at
  inline_container.cc] unexpected pos` with no errno: `CheckpointDiskFull`, with the space;
- read-only (remounted so after an I/O error, or by an operator) — EROFS from a mkdir, or torch's
  `open file failed with strerror: Read-only file system`: the mount's own flag says so.

A `step-NNNNNN` that still fails verification (disk corruption, a hand edit) is skipped by
`latest_checkpoint` with a warning, which then falls back to the previous one.

State files hold no arbitrary pickles: JSON for plain state, and for optimizer / scheduler state
`torch.save` read back with `torch.load(weights_only=True)`, which only rebuilds tensors and
primitive containers. That format was chosen over safetensors + JSON because optimizer state is
a nested tree (param groups of hyperparameters, per-parameter dicts holding tensors and step
counters) that safetensors cannot hold without a hand-made flattening scheme. torch is imported
inside those two helpers only: the rest of this module (and `grpod ctl`, and the crash tests'
child processes) then starts without paying torch's ~3 s import.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from grpod.run.filesystem import refused_write

log = structlog.get_logger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_OLD_DIR = re.compile(r"^\.old-step-(\d+)-[0-9a-f]+$")
_HASH_CHUNK = 1 << 20


class CheckpointError(Exception):
    """A checkpoint could not be written, found or used."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint directory is incomplete or its files do not match its manifest."""


class CheckpointNotWritten(CheckpointError):
    """A checkpoint write failed because of its filesystem (read-only, full); nothing of it is
    left, older checkpoints are intact. The message names the filesystem, the file and the cure."""

    def __init__(self, message: str, *, mount: Path, path: Path) -> None:
        super().__init__(message)
        self.mount, self.path = mount, path


class CheckpointDiskFull(CheckpointNotWritten):
    """A checkpoint write ran out of space."""


class ResumeError(CheckpointError):
    """`run.resume` names something that cannot be resumed from."""


class NoUsableCheckpoint(ResumeError):
    """run.resume = "auto" found checkpoints, and not one of them verifies: starting afresh would
    silently throw the run away (and overwrite their names), so the start is refused."""


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict[str, Any]

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest.get("meta", {})


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_and_fsync(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(fh.fileno())
    return size, digest.hexdigest()


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _seal(tmpdir: Path) -> list[dict[str, Any]]:
    """fsync every file and directory populate wrote; return the manifest's file list."""
    files: list[dict[str, Any]] = []
    for dirpath, dirnames, filenames in os.walk(tmpdir):
        here = Path(dirpath)
        for name in dirnames:
            if (here / name).is_symlink():
                raise CheckpointError(
                    f"{here / name}: checkpoint contents must be plain files and directories, not symlinks"
                )
        for name in filenames:
            path = here / name
            rel = path.relative_to(tmpdir).as_posix()
            if rel == MANIFEST_NAME:
                raise CheckpointError(f"populate wrote {MANIFEST_NAME!r}, a name reserved for the checkpoint manifest")
            if path.is_symlink() or not path.is_file():
                raise CheckpointError(f"{path}: checkpoint contents must be plain files, not links or devices")
            size, sha = _hash_and_fsync(path)
            files.append({"path": rel, "size": size, "sha256": sha})
        _fsync_path(here)
    files.sort(key=lambda entry: entry["path"])
    return files


def _write_manifest(tmpdir: Path, manifest: dict[str, Any]) -> None:
    with open(tmpdir / MANIFEST_NAME, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_path(tmpdir)


def _remove_out_of_view(path: Path, prefix: str) -> None:
    """Rename `path` to a hidden name first (atomic), then delete it."""
    hidden = path.with_name(f"{prefix}{path.name}-{secrets.token_hex(4)}")
    os.rename(path, hidden)
    _fsync_path(path.parent)
    _remove(hidden)


def _remove(path: Path) -> None:
    """Delete a checkpoint directory; one that is a symbolic link (an operator moved a checkpoint
    to another disk) loses the link only: what it points at is the operator's."""
    if path.is_symlink():
        target = os.readlink(path)
        path.unlink()
        log.info("checkpoint_link_removed", path=str(path), target=target, note="what it points at is left alone")
    else:
        shutil.rmtree(path)


def write_checkpoint(
    root: Path,
    step: int,
    populate: Callable[[Path], None],
    meta: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write a complete checkpoint for `step` under `root` and return its directory.

    `populate(tmpdir)` writes the checkpoint's files (model weights, trainer state, ...) into a
    fresh private directory. `meta` (JSON-serialisable; `policy_version` and `config_hash` are
    lifted to the manifest's top level) is recorded in the manifest. After the rename,
    checkpoints beyond the `keep_last` newest are pruned; the one just written never is, and
    hidden directories of other writers are never touched.
    """
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last} (the checkpoint just written is always kept)")
    started = time.monotonic()
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmpdir = root / f".tmp-{final.name}-{secrets.token_hex(4)}"
    try:
        tmpdir.mkdir()
    except OSError as exc:
        named = _not_written(root, None, final, exc)
        if named is not None:
            raise named from exc
        raise
    try:
        populate(tmpdir)
        files = _seal(tmpdir)
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "policy_version": meta.get("policy_version"),
            "config_hash": meta.get("config_hash"),
            "created": datetime.now(UTC).isoformat(),
            "files": files,
            "meta": meta,
        }
        _write_manifest(tmpdir, manifest)
    except BaseException as exc:
        named = _not_written(tmpdir, tmpdir, final, exc) if isinstance(exc, Exception) else None
        shutil.rmtree(tmpdir, ignore_errors=True)
        if named is not None:
            raise named from exc
        raise
    aside = None
    if final.exists():
        aside = root / f".old-{final.name}-{secrets.token_hex(4)}"
        os.rename(final, aside)
    os.rename(tmpdir, final)
    _fsync_path(root)
    if aside is not None:
        _remove(aside)
    log.info(
        "checkpoint_written",
        path=str(final),
        step=step,
        files=len(files),
        bytes=sum(entry["size"] for entry in files),
        seconds=round(time.monotonic() - started, 3),
    )
    _prune(root, keep_last=keep_last, keep=final)
    return final


def _not_written(within: Path, tmpdir: Path | None, final: Path, exc: Exception) -> CheckpointNotWritten | None:
    """`exc` as a CheckpointNotWritten when the write failed because of its filesystem (full, or
    read-only: `grpod.run.filesystem`), else None. `tmpdir` is None when the write failed making it."""
    why = refused_write(within, tmpdir, final, exc)
    if why is None:
        return None
    kind = CheckpointDiskFull if why.full else CheckpointNotWritten
    return kind(f"{why.said(exc)}; the checkpoint was not written (older ones are intact): {why.cure}",
                mount=why.mount, path=why.path)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every visible `step-NNNNNN` directory under root, ascending by step."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    found.sort(key=lambda item: item[0])
    return found


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST_NAME
    try:
        text = manifest_path.read_text()
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: {MANIFEST_NAME} is missing (an incomplete write?)") from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{manifest_path}: cannot read: {exc.strerror}") from None
    try:
        manifest = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{manifest_path}: not valid JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpointError(f"{manifest_path}: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("format") != FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{manifest_path}: format {manifest.get('format')!r}, this grpod reads format {FORMAT_VERSION}"
        )
    step = manifest.get("step")
    files = manifest.get("files")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CorruptCheckpointError(f"{manifest_path}: 'step' must be a non-negative integer, got {step!r}")
    if not isinstance(files, list):
        raise CorruptCheckpointError(f"{manifest_path}: 'files' must be a list, got {type(files).__name__}")
    if not files:  # every checkpoint holds weights and state: an empty list verifies nothing
        raise CorruptCheckpointError(f"{manifest_path}: 'files' lists no file")
    return manifest


def _checked_entry(path: Path, entry: Any) -> tuple[Path, int, str]:
    if not isinstance(entry, dict):
        raise CorruptCheckpointError(f"{path / MANIFEST_NAME}: file entry {entry!r} is not an object")
    rel, size, sha = entry.get("path"), entry.get("size"), entry.get("sha256")
    if not isinstance(rel, str) or not isinstance(size, int) or not isinstance(sha, str):
        raise CorruptCheckpointError(f"{path / MANIFEST_NAME}: malformed file entry {entry!r}")
    parts = Path(rel).parts
    if Path(rel).is_absolute() or ".." in parts or not parts:
        raise CorruptCheckpointError(f"{path / MANIFEST_NAME}: file path {rel!r} escapes the checkpoint")
    return path / rel, size, sha


def verify_checkpoint(path: Path) -> CheckpointInfo:
    """Check the manifest and every file's size and sha256; raise CorruptCheckpointError naming the file.

    This reads every byte of the checkpoint.
    """
    path = Path(path)
    if not path.is_dir():
        raise CorruptCheckpointError(f"{path}: not a checkpoint directory (does not exist or is not a directory)")
    manifest = _read_manifest(path)
    match = _STEP_DIR.match(path.name)
    if match and int(match.group(1)) != manifest["step"]:
        raise CorruptCheckpointError(
            f"{path}: directory name says step {int(match.group(1))}, manifest says step {manifest['step']}"
        )
    for entry in manifest["files"]:
        file, size, sha = _checked_entry(path, entry)
        if not file.is_file():
            raise CorruptCheckpointError(f"{file}: listed in the manifest but missing")
        actual_size = file.stat().st_size
        if actual_size != size:
            raise CorruptCheckpointError(f"{file}: size {actual_size} bytes, manifest says {size}")
        actual_sha = _file_digest(file)
        if actual_sha != sha:
            raise CorruptCheckpointError(
                f"{file}: sha256 {actual_sha[:12]}…, manifest says {sha[:12]}… (corrupted)"
            )
    return CheckpointInfo(path=path, step=manifest["step"], manifest=manifest)


def list_checkpoints(root: Path) -> list[CheckpointInfo]:
    """Complete checkpoints under root (manifest present and readable), ascending by step.

    File contents are not hashed here; `verify_checkpoint` / `latest_checkpoint` do that.
    """
    infos = []
    for step, path in _step_dirs(Path(root)):
        try:
            manifest = _read_manifest(path)
        except CorruptCheckpointError:
            continue
        infos.append(CheckpointInfo(path=path, step=step, manifest=manifest))
    return infos


def latest_checkpoint(root: Path) -> CheckpointInfo | None:
    """The newest checkpoint that verifies; incomplete or corrupt ones are skipped with a warning."""
    for _step, path in reversed(_step_dirs(Path(root))):
        try:
            return verify_checkpoint(path)
        except CorruptCheckpointError as exc:
            log.warning("checkpoint_skipped", path=str(path), reason=str(exc))
    return None


def _prune(root: Path, *, keep_last: int, keep: Path) -> None:
    complete = list_checkpoints(root)
    doomed = [info for info in complete[:-keep_last] if info.path != keep] if len(complete) > keep_last else []
    for info in doomed:
        try:
            _remove_out_of_view(info.path, ".del-")
        except OSError as exc:  # the checkpoint just written stands; the next prune tries again
            log.warning("checkpoint_prune_failed", path=str(info.path), error=f"{type(exc).__name__}: {exc}")
            continue
        log.info("checkpoint_pruned", path=str(info.path), step=info.step, keep_last=keep_last)


def clean_stale_temp(root: Path) -> list[Path]:
    """Tidy what killed writers left behind; call once at start, before any writer runs.

    Removes `.tmp-*` (unfinished writes) and `.del-*` (unfinished prunes). An `.old-step-N-*`
    left by a kill in the middle of a same-step replace is put back as `step-N` when no
    `step-N` exists (and it verifies), else removed. Returns the paths removed.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        old = _OLD_DIR.match(entry.name)
        if old:
            target = root / step_dir_name(int(old.group(1)))
            if not target.exists():
                try:
                    verify_checkpoint(entry)
                except CorruptCheckpointError as exc:
                    log.warning("checkpoint_skipped", path=str(entry), reason=str(exc))
                else:
                    os.rename(entry, target)
                    _fsync_path(root)
                    log.warning("checkpoint_restored", path=str(target), from_path=str(entry))
                    continue
        elif not entry.name.startswith((".tmp-", ".del-")):
            continue
        try:
            _remove(entry)
        except OSError as exc:  # left for the operator; it is out of every reader's view
            log.warning("stale_checkpoint_temp_kept", path=str(entry), error=f"{type(exc).__name__}: {exc}")
            continue
        removed.append(entry)
        log.info("stale_checkpoint_temp_removed", path=str(entry))
    return removed


def resolve_resume(root: Path, resume: str) -> CheckpointInfo | None:
    """Apply `run.resume`: "auto" (newest valid under root, or None), "never" (None), or a path.

    A path must be a checkpoint directory that verifies; anything else is a ResumeError that
    says what was found.
    """
    if resume == "never":
        return None
    if resume == "auto":
        latest = latest_checkpoint(root)
        if latest is None and _step_dirs(Path(root)):
            raise NoUsableCheckpoint(_none_usable(Path(root)))
        return latest
    path = Path(resume).expanduser()
    if not path.exists():
        raise ResumeError(
            f"run.resume = {resume!r}: no such path; use 'auto', 'never' or the path of a "
            f"step-NNNNNN checkpoint directory (e.g. under {root})"
        )
    if path.is_dir() and not (path / MANIFEST_NAME).exists() and _step_dirs(path):
        raise ResumeError(
            f"run.resume = {resume!r} is a checkpoint root, not a checkpoint; name one of its "
            f"step-NNNNNN directories, or set run.resume = 'auto' to take the newest"
        )
    try:
        return verify_checkpoint(path)
    except CorruptCheckpointError as exc:
        raise ResumeError(f"run.resume = {resume!r}: cannot resume from it: {exc}") from None


ORIGIN_NAME = ".origin.json"
SUPERSEDED_DIR = "superseded"


def resume_from(root: Path, resume: str) -> tuple[CheckpointInfo | None, bool]:
    """`resolve_resume`, except that a `run.resume = PATH` applied already is not applied again;
    (the checkpoint or None, whether `begin_line` must follow once the start is accepted).

    A start from PATH (or from step 0: "never") begins a new line of checkpoints in `root`. A
    later start with the same PATH — the config file still says it, systemd restarted the daemon —
    resumes that line's newest checkpoint, not PATH again: a restart never throws away what the
    new line trained (nor fails because rotation pruned PATH since). "never" means what it says
    at every start."""
    root = Path(root)
    if resume not in ("auto", "never"):
        origin = _read_origin(root)
        if origin is not None and origin.get("resume") == _resolved(resume):
            latest = latest_checkpoint(root)
            if latest is not None and latest.step > origin.get("step", 0):
                log.info("resume_line_continued", resume=resume, checkpoint=str(latest.path), step=latest.step,
                         note=f"run.resume = PATH was applied at {origin.get('at')}; this resumes the newest "
                         "checkpoint written since (run.resume = 'auto' says the same)")
                return latest, False
    return resolve_resume(root, resume), resume != "auto"


def begin_line(root: Path, resume: str, info: CheckpointInfo | None) -> list[Path]:
    """A start with `run.resume` = "never" or a PATH (`resume_from`) was accepted: every
    checkpoint of `root` newer than the start (every one, for a fresh start) belongs to the run
    that was left and is moved out of view, to `<root>/superseded/<time>/`, so no later "auto"
    start resumes it and rotation never prunes the new line for it; the start is recorded
    (`.origin.json`). Returns where the moved checkpoints went."""
    root = Path(root)
    start = info.step if info is not None else -1
    kept = info.path.resolve() if info is not None else None
    newer = [path for step, path in _step_dirs(root) if step > start and path.resolve() != kept]
    moved = []
    if newer:
        aside = root / SUPERSEDED_DIR / datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        aside.mkdir(parents=True)
        for path in newer:
            os.rename(path, aside / path.name)
            moved.append(aside / path.name)
        _fsync_path(root)
        log.warning("checkpoints_superseded", moved=[p.name for p in moved], to=str(aside),
                    note=f"run.resume = {resume!r} starts a new line at step {max(start, 0)}; the newer "
                    "checkpoints of the run it left are kept there, out of view: delete them when not needed")
    root.mkdir(parents=True, exist_ok=True)
    record = {"resume": "never" if resume == "never" else _resolved(resume), "step": max(start, 0),
              "at": datetime.now(UTC).isoformat(timespec="seconds")}
    written = root / f".tmp-{ORIGIN_NAME}"
    written.write_text(json.dumps(record))
    os.replace(written, root / ORIGIN_NAME)
    return moved


def _resolved(resume: str) -> str:
    return str(Path(resume).expanduser().resolve())


def _read_origin(root: Path) -> dict | None:
    try:
        record = json.loads((Path(root) / ORIGIN_NAME).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step", 0), int) else None


def _none_usable(root: Path) -> str:
    lines = []
    for _step, path in _step_dirs(root):
        try:
            verify_checkpoint(path)
        except CorruptCheckpointError as exc:
            lines.append(f"  {path.name}: {exc}")
    return (
        f"run.resume = 'auto': none of the {len(lines)} checkpoints under {root} can be resumed:\n"
        + "\n".join(lines)
        + "\nrepair or remove them, name a good checkpoint with run.resume = PATH (or --resume PATH), or "
        "start afresh from step 0 with run.resume = \"never\" (--resume never), whose checkpoints replace these"
    )


def save_json(directory: Path, name: str, obj: Any) -> Path:
    """Write `obj` as JSON to `directory/name` (inside a checkpoint being populated)."""
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, sort_keys=True))
    return path


def load_json(directory: Path, name: str) -> Any:
    path = Path(directory) / name
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing from the checkpoint") from None
    except json.JSONDecodeError as exc:
        raise CorruptCheckpointError(f"{path}: not valid JSON: {exc}") from None


def _compact_tensors(obj: Any) -> Any:
    """Copy tensors that are views, so a save holds only their own bytes, not a whole fused storage."""
    import torch

    if isinstance(obj, torch.Tensor):
        own_bytes = obj.numel() * obj.element_size()
        if obj.untyped_storage().nbytes() != own_bytes or not obj.is_contiguous():
            return obj.detach().clone(memory_format=torch.contiguous_format)
        return obj.detach()
    if isinstance(obj, dict):
        return {key: _compact_tensors(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_compact_tensors(value) for value in obj)
    return obj


def save_tensors_state(directory: Path, name: str, state_dict: dict[str, Any]) -> Path:
    """Save an optimizer / scheduler state dict (tensors, numbers, strings, nested containers)."""
    import torch

    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(_compact_tensors(state_dict), path)
    return path


def load_tensors_state(directory: Path, name: str, map_location: str = "cpu") -> dict[str, Any]:
    """Load what `save_tensors_state` wrote; refuses anything but tensors and primitive containers."""
    import pickle

    import torch

    path = Path(directory) / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the checkpoint")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CorruptCheckpointError(
            f"{path}: not a plain tensor state (weights_only load refused it): {str(exc).splitlines()[0]}"
        ) from None
