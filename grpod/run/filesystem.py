"""Why a filesystem refused a write: the one reading of a failed write shared by checkpoints
(`grpod.run.checkpoint`) and the weights a sync ships (`grpod.weights.versions`).

A write fails on a full or read-only filesystem in more than one way, depending on which call
met it first: an OSError (ENOSPC, EDQUOT, EROFS) from mkdir or open, or a library's own error with
no errno — torch's writer says `[enforce fail at inline_container.cc] unexpected pos` on a full
disk and `open file failed with strerror: Read-only file system` on a read-only one;
safetensors raises a `SafetensorError`. So the filesystem itself is asked: its read-only flag
and its free space (`os.statvfs`), read before the partial write is removed (which frees the
space again), with the errnos of the exception's chain.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

# A failed write with less free space than this left on its filesystem ran out of it: a write
# fills the filesystem up to its last block before it fails.
DISK_FULL_FREE_BYTES = 1 << 20


@dataclass(frozen=True)
class Refusal:
    """A filesystem that refused a write: `full` (else read-only), its mount point, what it is,
    the file the write was writing (as it would have been named once published) and the cure."""

    full: bool
    mount: Path
    what: str  # "read-only file system at /run/x (tmpfs)", "no space left on /run/x (tmpfs, 0 of ... bytes free)"
    path: Path
    cure: str  # what an operator does about it

    def said(self, exc: BaseException) -> str:
        return f"{self.what} writing {self.path}: {cause(exc)}"


def refused_write(within: Path, partial: Path | None, final: Path, exc: BaseException) -> Refusal | None:
    """The filesystem of `within` as the reason `exc` was raised writing `partial` (a directory
    published as `final` once complete; None or absent: it could not be made), or None when the
    filesystem is neither read-only nor full (the failure is something else). Call it before the
    partial write is removed."""
    chain: BaseException | None = exc
    errnos: set[int] = set()
    for _ in range(10):
        if chain is None:
            break
        if isinstance(chain, OSError) and chain.errno is not None:
            errnos.add(chain.errno)
        chain = chain.__cause__ or chain.__context__
    try:
        fs = os.statvfs(within)
    except OSError:
        return None
    mount = mount_point(within)
    written = newest_file(partial) if partial is not None and partial.is_dir() else None
    path = final / written.relative_to(partial) if written is not None else final
    if errno.EROFS in errnos or fs.f_flag & os.ST_RDONLY:
        return Refusal(False, mount, f"read-only file system at {mount} ({fs_type(mount)})", path,
                       "make it writable again (a filesystem the kernel remounted read-only after an I/O error "
                       "needs its disk checked first)")
    free, total = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    if not errnos & {errno.ENOSPC, errno.EDQUOT} and free >= DISK_FULL_FREE_BYTES:
        return None
    return Refusal(True, mount, f"no space left on {mount} ({fs_type(mount)}, {free} of {total} bytes free)", path,
                   "free space there")


def cause(exc: BaseException) -> str:
    """`exc` in one line: its type and the first line of its message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else '-'}"


def mount_point(path: Path) -> Path:
    path = Path(os.path.realpath(path))
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def fs_type(mount: Path) -> str:
    try:
        with open("/proc/mounts") as fh:
            found = [line.split()[2] for line in fh if len(line.split()) > 2 and line.split()[1] == str(mount)]
    except OSError:
        return "filesystem"
    return found[-1] if found else "filesystem"


def newest_file(directory: Path) -> Path | None:
    """The file written last under `directory` (the one a failed write was writing)."""
    newest: tuple[int, Path] | None = None
    for dirpath, _dirs, names in os.walk(directory):
        for name in names:
            path = Path(dirpath) / name
            try:
                mtime = path.stat().st_mtime_ns
            except OSError:
                continue
            if newest is None or mtime >= newest[0]:
                newest = (mtime, path)
    return newest[1] if newest else None
