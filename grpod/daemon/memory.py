"""`MemoryWatch`: what the run's processes hold, read every `metrics.memory_every_s`.

A daemon that runs for days must show whether it, or an engine it supervises, grows. A reading:
- `daemon_rss`: the daemon's own resident bytes (the trainer lives in it);
- `engines`: per engine, the resident bytes of every process of its process group (vLLM's API
  server and its engine core), and the GPU bytes NVML reports for them (None on a machine without
  NVIDIA's driver). An engine on this node is read here (`grpod.inference.memory`); an engine of a
  `grpod agent` is read by its agent on its node (the agent's `GET /status` reads with the same
  `read_memory`) and asked for at each reading (`remote`); an agent that does not answer leaves
  its engines out of that reading;
- `children_rss`: the daemon's other descendants (reward workers, environment servers and
  workers).
Resident bytes count a shared page in every process that maps it (the `shared` bridge's weights
are in the daemon's and in vLLM's).

Each reading is a `memory` record in metrics.jsonl, in MiB (`grpod plot` draws them;
`bench/memory_soak.py` fits the growth per step from them) and `ctl status`'s `memory` (the last reading, and its change since the first
one of this process), which Prometheus exports.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import anyio
import psutil
import structlog

from grpod.inference.memory import MemoryReading, read_memory
from grpod.inference.release import nvidia_gpu_count
from grpod.service.logs import MetricsLog

log = structlog.get_logger(__name__)

class MemoryWatch:
    """Reads `read_memory` every `every_s` in a worker thread while the run trains; `engines()`
    names the local engines' process groups at each reading."""

    def __init__(self, every_s: float, metrics: MetricsLog, step: Callable[[], int],
                 engines: Callable[[], dict[str, int]],
                 remote: Callable[[], Awaitable[dict[str, dict[str, int | None]]]] | None = None) -> None:
        self.every_s = every_s
        self.metrics = metrics
        self.step = step
        self.engines = engines
        self.remote = remote  # engines on other nodes: name -> {"rss", "gpu"}, as their agents read them
        self.first: MemoryReading | None = None
        self.last: MemoryReading | None = None

    async def run(self) -> None:
        gpu = await anyio.to_thread.run_sync(nvidia_gpu_count) > 0
        while True:
            try:
                groups = self.engines()  # read on the event loop, which changes them
                reading = await anyio.to_thread.run_sync(partial(read_memory, groups, gpu=gpu))
                if self.remote is not None:
                    reading = replace(reading, engines={**reading.engines, **await self.remote()})
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
