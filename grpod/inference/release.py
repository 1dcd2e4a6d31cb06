"""Waiting until a stopped vLLM has really let go: its processes, its port, its accelerator memory.

A vLLM server is two or three processes (API server → EngineCore [→ Worker]: one CPU engine runs
its worker inside EngineCore, `inference.cpu_executor`); killing the first leaves the others
orphaned, still holding the weights, the port's connections and, on a GPU, gigabytes of
memory. A relaunch that starts before they are gone fails or runs out of memory. Every function
here waits for one resource with a timeout and raises `ReleaseTimeoutError` naming what is still
held, so a stuck release is an error, never a silent hang.

Processes are found by process group (`pgid`), the only handle grpod has on what it launched:
children keep the group when they are re-parented, and nothing outside the group is ever touched.
Zombies count as gone: they hold no memory and no port, and reaping re-parented ones is init's job.
"""

from __future__ import annotations

import errno
import math
import os
import shlex
import socket
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

import anyio
import psutil
import structlog

log = structlog.get_logger(__name__)

POLL_INTERVAL_S = 0.1
SHM_DIR = Path("/dev/shm")
# What vLLM leaves in /dev/shm after a kill: multiprocessing.shared_memory segments of its message
# queues and the POSIX semaphores of multiprocessing locks. Other /dev/shm files (grpod's shared
# weights among them) are never removed here, whoever maps them.
VLLM_SHM_PREFIXES = ("psm_", "sem.mp-")


class ReleaseTimeoutError(TimeoutError):
    """A resource of a stopped vLLM was still held when the timeout expired."""


def group_members(pgid: int) -> list[psutil.Process]:
    """The live processes whose process group is `pgid`: a zombie is dead unless its threads are
    not all gone (`still_exiting`)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and (proc.status() != psutil.STATUS_ZOMBIE or still_exiting(proc)):
                members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return members


def still_exiting(proc: psutil.Process) -> bool:
    """Whether a zombie `proc` still has threads running. A process whose main thread has ended
    shows as a zombie while its other threads are still exiting (the last one releasing its
    memory: a vLLM server on a clean stop); it holds its memory and its port, and its parent cannot
    reap it yet (a review saw it on 15 of ~22 clean stops of the tiny model's server, each then
    taken for a leader that had left its group and SIGKILLed)."""
    try:
        return proc.num_threads() > 1
    except psutil.NoSuchProcess:  # ZombieProcess included: nothing more to read of it
        return False


def process_env(proc: psutil.Process, name: str) -> str | None:
    """One environment variable of another process (None if gone or unreadable)."""
    try:
        return proc.environ().get(name)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def port_is_free(host: str, port: int) -> bool:
    """True when a new server could listen on `host:port` now.

    SO_REUSEADDR is set as uvicorn sets it, so connections in TIME_WAIT do not count as held.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def free_port(host: str) -> int:
    """A port on `host` that is free now (the kernel's pick; another process may take it later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def nvidia_gpu_count() -> int:
    """Number of NVIDIA GPUs NVML can see; 0 when there is no driver (every CPU machine)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        return pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()


def gpu_memory_by_pid() -> dict[int, int]:
    """Bytes of GPU memory each process holds, over all devices, in one NVML pass ({} without NVML).

    NVML reports host PIDs; inside a PID namespace they may not match the PIDs seen here.
    """
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return {}
    try:
        held: dict[int, int] = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                held[proc.pid] = held.get(proc.pid, 0) + (proc.usedGpuMemory or 0)
        return held
    finally:
        pynvml.nvmlShutdown()


def gpu_memory_held(pids: Iterable[int]) -> int:
    """Bytes of GPU memory that processes `pids` hold, over all devices (0 without NVML)."""
    held = gpu_memory_by_pid()
    return sum(held.get(pid, 0) for pid in set(pids))


async def wait_until(released: Callable[[], bool], timeout_s: float, what: Callable[[], str]) -> None:
    """Poll `released` (there is no event for "a process group is empty") until it holds."""
    with anyio.move_on_after(timeout_s):
        while not released():
            await anyio.sleep(POLL_INTERVAL_S)
        return
    raise ReleaseTimeoutError(f"{what()} still held after {timeout_s:g} s")


async def wait_group_gone(pgid: int, timeout_s: float) -> None:
    """Return once no live process of group `pgid` remains."""

    def what() -> str:
        left = [f"{p.pid} ({' '.join(_cmdline(p))[:80]})" for p in group_members(pgid)]
        return f"process group {pgid}: processes {', '.join(left) or '(none left)'}"

    await wait_until(lambda: not group_members(pgid), timeout_s, what)


async def wait_port_free(host: str, port: int, timeout_s: float) -> None:
    """Return once a new server could listen on `host:port`."""
    await wait_until(
        lambda: port_is_free(host, port),
        timeout_s,
        lambda: f"port {port} on {host} (find the holder with `ss -ltnp 'sport = :{port}'`)",
    )


async def wait_gpu_memory_released(pids: Iterable[int], timeout_s: float) -> None:
    """Return once processes `pids` hold no GPU memory on any device (checks nothing without NVML)."""
    pids = frozenset(pids)
    await wait_until(
        lambda: gpu_memory_held(pids) == 0,
        timeout_s,
        lambda: f"GPU memory of processes {sorted(pids)}: {math.ceil(gpu_memory_held(pids) / 2**20)} MiB",
    )


def vllm_shm_segments(processes: Iterable[psutil.Process]) -> set[Path]:
    """The vLLM-named /dev/shm files that `processes` map: leftovers to remove once they are gone.

    Only files these processes demonstrably map are returned, so another server's segments (or
    grpod's own shared weights) are never candidates.
    """
    segments: set[Path] = set()
    for proc in processes:
        try:
            maps = proc.memory_maps(grouped=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for region in maps:
            path = Path(region.path)
            if path.parent == SHM_DIR and path.name.startswith(VLLM_SHM_PREFIXES):
                segments.add(path)
    return segments


def remove_shm_segments(segments: Iterable[Path]) -> list[Path]:
    """Unlink the given leftovers that still exist; returns the ones removed."""
    removed = []
    for path in segments:
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("shm_segment_not_removed", path=str(path), error=exc.strerror)
            continue
        removed.append(path)
    return removed


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return ["?"]


def port_holder(port: int, *, exclude_pgid: int | None = None) -> str | None:
    """'pid N (command line)' of a process listening on TCP `port` outside process group
    `exclude_pgid`, or None (none found, or not visible to this user)."""
    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    for conn in connections:
        if conn.status != psutil.CONN_LISTEN or not conn.laddr or conn.laddr.port != port or conn.pid is None:
            continue
        try:
            proc = psutil.Process(conn.pid)
            if exclude_pgid is not None and os.getpgid(conn.pid) == exclude_pgid:
                continue
            return f"pid {conn.pid} ({shlex.join(proc.cmdline())[:200]})"
        except (psutil.Error, ProcessLookupError):
            continue
    return None


async def reap_leader(popen: subprocess.Popen[bytes], pgid: int, timeout_s: float) -> int:
    """Reap a server's leader once its group `pgid` is gone: it has exited, or is a zombie whose
    last threads are still exiting (its parent cannot reap it until they are gone: waited for), or
    it left the group (setpgid/setsid: killed, by its PID, which is ours while unreaped). Its exit
    code."""
    code = popen.poll()
    if code is None:
        left = _left_group(popen.pid, pgid)
        if left:
            log.warning("inference_leader_left_group", pid=popen.pid)
            popen.kill()
        try:
            code = await anyio.to_thread.run_sync(popen.wait, timeout_s)
        except subprocess.TimeoutExpired:
            raise ReleaseTimeoutError(
                f"vLLM server process {popen.pid} still running {timeout_s:g} s after "
                + ("SIGKILL" if left else "its process group was gone")
            ) from None
    return code


def _left_group(pid: int, pgid: int) -> bool:
    """Whether the unreaped leader `pid` is alive outside the group `pgid` it was launched in. A
    zombie (even one still exiting) has not left: its group id is still the launch's."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE and os.getpgid(pid) != pgid
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False
