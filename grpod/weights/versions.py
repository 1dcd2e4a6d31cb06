"""`VersionedDirs`: one directory per policy version (`<root>/v000007`), written atomically.

The bridges ship vLLM the trainer's weights through these: full HF checkpoints in `<run>/weights`
(`none`), adapters in `<run>/adapters` (the LoRA modes). The one format of a version directory's
name is `version_dir_name`.

Guarantees:
- a version directory is complete or absent: it is written under a hidden partial name and
  renamed into place once the writer returned (a directory of the same version left by a failed
  sync or an earlier run is replaced);
- a write the filesystem refused (read-only, full) is a `WeightsNotWritten` naming it, whatever
  the writer raised (safetensors' own error has no errno): the bridge's sync takes it as a sync
  not saved, not as a broken bridge;
- `prune` keeps the newest `keep` versions up to the current one (never fewer than
  `MIN_KEPT`: vLLM may still be finishing requests on the previous version, and reloads an
  evicted adapter from its directory), removes every version newer than the current one (left by
  an earlier run that got further than the checkpoint it resumed from) and every partial write,
  and never removes a directory named in `protect` (what an engine was launched on).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import structlog

from grpod.run.filesystem import refused_write

log = structlog.get_logger(__name__)

MIN_KEPT = 2
_VERSION_DIR = re.compile(r"^v(\d{6,})$")
_PARTIAL_PREFIX = ".partial-"


class WeightsNotWritten(OSError):
    """A version's files could not be written because of their filesystem (read-only, full),
    whichever call met it (`grpod.run.filesystem`); an OSError, as a failed mkdir or open is."""


def version_dir_name(version: int) -> str:
    return f"v{version:06d}"


class VersionedDirs:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path_for(self, version: int) -> Path:
        return self.root / version_dir_name(version)

    def versions(self) -> list[int]:
        """Versions with a published directory, oldest first."""
        if not self.root.exists():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _VERSION_DIR.match(entry.name)
            if match and entry.is_dir():
                found.append(int(match.group(1)))
        return sorted(found)

    def write(self, version: int, writer: Callable[[Path], object]) -> Path:
        """`writer(directory)` fills a fresh partial directory, which is then published as
        `version`. Blocking: run it in a worker thread."""
        target = self.path_for(version)
        partial = self.root / f"{_PARTIAL_PREFIX}{target.name}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            writer(partial)
        except BaseException as exc:
            why = refused_write(self.root, partial, target, exc) if isinstance(exc, Exception) else None
            shutil.rmtree(partial, ignore_errors=True)
            if why is not None:
                raise WeightsNotWritten(f"{why.said(exc)}: {why.cure}") from exc
            raise
        if target.exists():
            shutil.rmtree(target)
        partial.rename(target)
        return target

    def adopt(self, version: int, source: Path) -> Path:
        """Publish the files of `source` (e.g. a checkpoint's model) as `version`, hard-linked
        where the file system allows (no copy of the weights), copied otherwise."""

        def link_all(partial: Path) -> None:
            for path in sorted(Path(source).rglob("*")):
                target = partial / path.relative_to(source)
                if path.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(path, target)
                except OSError:
                    shutil.copy2(path, target)

        return self.write(version, link_all)

    def prune(self, current: int, keep: int, protect: Iterable[Path] = ()) -> list[int]:
        """Remove all but the newest `max(keep, MIN_KEPT)` versions up to `current`, every version
        after it, and partial writes; never a directory in `protect`. Returns the versions removed."""
        keep = max(keep, MIN_KEPT)
        protected = {Path(p).resolve() for p in protect}
        versions = self.versions()
        kept = [v for v in versions if v <= current][-keep:]
        removed = [v for v in versions if v not in kept and self.path_for(v).resolve() not in protected]
        for version in removed:
            shutil.rmtree(self.path_for(version), ignore_errors=True)
        if self.root.exists():
            for entry in self.root.iterdir():
                if entry.name.startswith(_PARTIAL_PREFIX):
                    shutil.rmtree(entry, ignore_errors=True)
        if removed:
            log.info("versions_pruned", root=str(self.root), removed=removed, kept=kept)
        return removed
