"""What a process group holds: one reading of this process and its descendants, each engine's
process group apart (`read_memory`).

The daemon's memory watch (`grpod.daemon.memory`) reads with it on the leader's node, and a
`grpod agent` with it on its own node (its `GET /status`): the figures mean the same wherever an
engine runs. Resident bytes count a shared page in every process that maps it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import psutil

from grpod.inference.release import gpu_memory_by_pid

MIB = 1 << 20


@dataclass(frozen=True)
class MemoryReading:
    time: float
    daemon_rss: int
    children_rss: int
    engines: dict[str, dict[str, int | None]]  # name -> {"rss": bytes, "gpu": bytes or None}

    def record(self) -> dict[str, float]:
        """Its metrics.jsonl record: flat numbers in MiB (what `grpod plot` draws and W&B logs),
        `engine_rss_mib/<engine>` and, where NVML reads it, `engine_gpu_mib/<engine>`."""
        out = {"daemon_rss_mib": _mib(self.daemon_rss), "children_rss_mib": _mib(self.children_rss)}
        for name, held in self.engines.items():
            out[f"engine_rss_mib/{name}"] = _mib(held["rss"])
            if held["gpu"] is not None:
                out[f"engine_gpu_mib/{name}"] = _mib(held["gpu"])
        return out


def _mib(n: int | None) -> float:
    return round((n or 0) / MIB, 1)


def read_memory(engine_groups: dict[str, int], *, gpu: bool) -> MemoryReading:
    """One reading of this process and its descendants; `engine_groups`: each local engine's
    process group. A process that ends while it is read is left out."""
    me = psutil.Process()
    names = {pgid: name for name, pgid in engine_groups.items()}
    engines: dict[str, dict[str, Any]] = {name: {"rss": 0, "pids": []} for name in engine_groups}
    children = 0
    for child in me.children(recursive=True):
        try:
            rss, group = child.memory_info().rss, os.getpgid(child.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
            continue
        if group in names:
            engines[names[group]]["rss"] += rss
            engines[names[group]]["pids"].append(child.pid)
        else:
            children += rss
    by_pid = gpu_memory_by_pid() if gpu else None  # one NVML pass for every engine
    held = {
        name: {"rss": e["rss"], "gpu": None if by_pid is None else sum(by_pid.get(pid, 0) for pid in e["pids"])}
        for name, e in engines.items()
    }
    return MemoryReading(time.time(), me.memory_info().rss, children, held)
