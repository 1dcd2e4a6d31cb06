"""One daemon per run directory: `RunDirLock`, an exclusive lock on `<run.dir>/grpod.lock`.

The control socket's path is no guard (it can be deleted, or another `control.socket` chosen):
two daemons on one run directory would each take the other's vLLM for one "left behind" by a
killed predecessor and stop it, delete each other's weight files and interleave checkpoints. So
the daemon takes `fcntl.flock(LOCK_EX | LOCK_NB)` on the lock file before it touches anything in
the run directory and holds it for its whole life. The kernel releases a flock when the last
descriptor of its open file closes — at the daemon's death, however it dies — so a stale lock
cannot outlive its holder, and no PID check is trusted for it. The descriptor is close-on-exec
(vLLM and other children never inherit it). The holder writes its PID into the file, which a
refused second daemon names.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = "grpod.lock"


class RunDirInUse(Exception):
    """Another live process holds the run directory's lock."""

    def __init__(self, run_dir: Path, lock: Path, holder: int | None) -> None:
        self.run_dir, self.lock, self.holder = run_dir, lock, holder
        who = f"grpod pid {holder}" if holder is not None else "another grpod (its pid unrecorded)"
        super().__init__(
            f"run directory {run_dir} is in use by {who} (it holds {lock}); one daemon per run directory: "
            f"stop that one first (`grpod ctl stop`, or SIGTERM to pid {holder if holder is not None else '?'}), "
            "or give this one another run.dir"
        )


class RunDirLock:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock now or raise RunDirInUse naming the holder's PID; never waits."""
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise RunDirInUse(self.run_dir, self.path, holder) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Give the lock up (the file stays: removing it would let two daemons lock two files)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.ftruncate(fd, 0)
        os.close(fd)

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
