"""`MemoryWatch`: what the run's processes on this node hold, read every `metrics.memory_every_s`.

A daemon that runs for days must show whether it, or an engine it supervises, grows. A reading:
- `daemon_rss`: the daemon's own resident bytes (the trainer lives in it);
- `engines`: per engine on this node, the resident bytes of every process of its process group
  (vLLM's API server and its engine core), and the GPU bytes NVML reports for them (None on a
  machine without NVIDIA's driver);
- `children_rss`: the daemon's other descendants (reward workers, environment servers and
  workers).
Resident bytes count a shared page in every process that maps it (the `shared` bridge's weights
are in the daemon's and in vLLM's). Remote engines are their agents' to read.

Each reading is a `memory` record in metrics.jsonl, in MiB (`grpod plot` draws them;
`bench/memory_soak.py` fits the growth per step from them) and `ctl status`'s `memory` (the last reading, and its change since the first
one of this process), which Prometheus exports.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import psutil
import structlog

from grpod.inference.release import gpu_memory_by_pid, nvidia_gpu_count
from grpod.service.logs import MetricsLog

log = structlog.get_logger(__name__)

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


class MemoryWatch:
    """Reads `read_memory` every `every_s` in a worker thread while the run trains; `engines()`
    names the local engines' process groups at each reading."""

    def __init__(self, every_s: float, metrics: MetricsLog, step: Callable[[], int],
                 engines: Callable[[], dict[str, int]]) -> None:
        self.every_s = every_s
        self.metrics = metrics
        self.step = step
        self.engines = engines
        self.first: MemoryReading | None = None
        self.last: MemoryReading | None = None

    async def run(self) -> None:
        gpu = await anyio.to_thread.run_sync(nvidia_gpu_count) > 0
        while True:
            try:
                groups = self.engines()  # read on the event loop, which changes them
                reading = await anyio.to_thread.run_sync(partial(read_memory, groups, gpu=gpu))
            except (psutil.Error, OSError) as exc:  # a reading that fails is skipped, not the run
                log.warning("memory_read_failed", error=str(exc))
            else:
                self.first = self.first or reading
                self.last = reading
                self.metrics.write("memory", self.step(), reading.record())
            await anyio.sleep(self.every_s)

    def describe(self) -> dict[str, Any] | None:
        """The last reading, each figure's change since the first, and the seconds between them."""
        if self.last is None or self.first is None:
            return None
        last, first = self.last, self.first
        engines = {}
        for name, held in last.engines.items():
            before = first.engines.get(name)
            engines[name] = {**held, "rss_change": held["rss"] - before["rss"] if before else None}
        return {
            "daemon_rss": last.daemon_rss,
            "daemon_rss_change": last.daemon_rss - first.daemon_rss,
            "children_rss": last.children_rss,
            "engines": engines,
            "since_s": round(last.time - first.time, 1),
            "age_s": round(time.time() - last.time, 1),
        }
