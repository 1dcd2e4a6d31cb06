"""What a process grpod starts does so that it cannot outlive grpod or take its memory: the reward
workers, the environment workers and servers, and the vLLM servers the daemon and the agent launch.

- `parent_env`: what the starting process adds to the child's environment (its own PID);
- `die_with_parent`: the child asks the kernel for a signal when that process dies
  (PR_SET_PDEATHSIG), and exits at once if it died already;
- `stop_group_with_parent`: a child that leads a process group of its own (grpod's vLLM server)
  stops its group when that process dies — SIGTERM, then SIGKILL after a grace — as the parent's
  own stop would have;
- `watch_parent`: the general form (a trainer rank 0 stops as on torchrun's SIGTERM once torchrun
  is gone);
- `cap_memory`: the child caps its own data (RLIMIT_DATA).

Standard library only: the environment workers import it before anything of grpod's.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import threading
import time
from collections.abc import Callable

PR_SET_PDEATHSIG = 1
PARENT_PID_ENV = "GRPOD_PARENT_PID"
GRACE_ENV = "GRPOD_STOP_GRACE_S"
PARENT_POLL_S = 0.5


def parent_env(stop_grace_s: float | None = None) -> dict[str, str]:
    """What a process that starts a child adds to its environment: its own PID, for
    `die_with_parent`, and for `stop_group_with_parent` the grace between SIGTERM and SIGKILL.
    With `die_with_parent` the child must be started from a thread that lives as long as the
    process (the event loop's): PR_SET_PDEATHSIG fires when the thread that forked it ends."""
    env = {PARENT_PID_ENV: str(os.getpid())}
    if stop_grace_s is not None:
        env[GRACE_ENV] = repr(float(stop_grace_s))
    return env


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when the process that started it dies, and exit
    now if it died already (before the prctl took effect): the parent is then no longer the one
    that named itself in PARENT_PID_ENV (`parent_env`). Not "the parent is PID 1": grpod may be a
    container's first process. Children this process forks do not inherit the request."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass
    _named_parent()


def _named_parent() -> int | None:
    """The PID the starting process named (`parent_env`), taken out of the environment so that
    what this process starts does not inherit it; exits now if that process is gone already (this
    process was handed to a reaper before it could watch). None when no parent was named."""
    expected = os.environ.pop(PARENT_PID_ENV, None)
    if expected is None:
        return None
    if os.getppid() != int(expected):
        os._exit(1)
    return int(expected)


def stop_group_with_parent() -> None:
    """Watch the process that started this one (`parent_env`) from a thread; once it is gone
    (killed, OOM), stop as its stop would have: SIGTERM to the process group this process leads
    (the one its parent created for it), then, if this process is still there after the grace,
    SIGKILL to the group. A process that leads no group signals itself alone.

    Not PR_SET_PDEATHSIG(SIGTERM): vLLM's server then shut its EngineCore down but waited for ever
    for its HTTP server's background tasks, and nothing came after. Left behind: a group member
    that ignores SIGTERM when the leader does not (the leader's thread is the one that would kill
    it). Nothing happens without PARENT_PID_ENV."""
    grace_s = float(os.environ.pop(GRACE_ENV, "5"))
    parent = _named_parent()
    if parent is None:
        return

    def signal_ours(sig: int) -> None:
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpid(), sig)
        else:
            os.kill(os.getpid(), sig)

    def stop() -> None:
        signal_ours(signal.SIGTERM)
        time.sleep(grace_s)
        signal_ours(signal.SIGKILL)

    watch_parent(parent, stop)


def watch_parent(parent: int, when_gone: Callable[[], None]) -> None:
    """Call `when_gone` (in a thread of its own) once this process's parent is no longer `parent`:
    it died, and this process was handed to a reaper."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        when_gone()

    threading.Thread(target=watch, name="grpod-parent-watch", daemon=True).start()


def cap_memory(memory_mb: int) -> None:
    """Cap this process's data (RLIMIT_DATA: heap and private mappings) at `memory_mb` MiB: an
    allocation past it fails (MemoryError in Python code) instead of growing until the kernel's
    OOM killer picks a victim, perhaps the daemon. The reward workers' and the environments'."""
    limit = memory_mb * 1024 * 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
