"""`SupervisedInference`: one vLLM engine on this node and everything that keeps it usable, in one owner.

It holds the engine's process (`InferenceProcess`: a process group of its own, a launch token,
release waits) and, from `InferenceEngine`, the lifetime of its HTTP client, the availability
gate, the version it serves, its outstanding requests, the health watch and its restart budget.
A pool of engines is a list of these; nothing here knows about the others, the trainer or the
bridge.

The health watch (`watch`) finds a lost engine three ways and hands it to the caller's `on_lost`
(the bridge relaunches and probes it):
- process death, event-driven: `InferenceProcess.wait_exit` waits on a pidfd, so a crash is seen
  at once and a long watch costs nothing;
- a hung engine: `/health` polled every `inference.health_interval_s` while the gate is open, and
  `inference.health_failures` failures in a row. A closed gate means the engine is being changed
  by its owner, who meets failures itself;
- a stalled engine, which answers `/health` but computes nothing: vLLM's token counters
  (`/metrics`) stand still for `inference.stall_timeout_s` with requests in flight, gate open.

Relaunches after a loss spend the restart budget (`inference.max_restarts`), with a back-off that
doubles from 1 s up to 30 s between relaunches of the same engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from grpod.config import InferenceConfig
from grpod.inference.engine import (
    FIRST_BACKOFF_S,
    MAX_BACKOFF_S,
    EngineLease,
    InferenceEngine,
    InferenceUnavailable,
    LostHandler,
    RestartBudgetSpent,
)
from grpod.inference.process import InferenceProcess

__all__ = [
    "FIRST_BACKOFF_S",
    "MAX_BACKOFF_S",
    "EngineLease",
    "InferenceUnavailable",
    "LostHandler",
    "RestartBudgetSpent",
    "SupervisedInference",
]


class SupervisedInference(InferenceEngine):
    """One engine on this node (see the module docstring). `launch`, `shutdown` and `relaunch`
    are called by its owner only (the bridge); requests go through `wait_open` / `Policy.engine`."""

    def __init__(self, process: InferenceProcess, cfg: InferenceConfig, *, name: str = "engine-0") -> None:
        super().__init__(cfg, name=name)
        self.process = process

    async def launch(self, weights: Path, version: int, **launch_kwargs: Any) -> None:
        """Start vLLM on `weights` (returns once healthy), open its client, tag `version`.
        The gate stays closed: the owner opens it once the engine passed its probe."""
        await self.process.start(weights, **launch_kwargs)
        try:
            await self._open_client(version, weights)
        except BaseException:
            await self.process.stop()
            raise

    async def shutdown(self) -> None:
        """Close the gate and the client, stop the process group and wait until it released its
        port and memory (bounded by `inference.stop_grace_s` / `release_timeout_s`)."""
        await self._close_client()
        with anyio.CancelScope(shield=True):
            await self.process.stop()

    async def _until_exited(self) -> str:
        code = await self.process.wait_exit()
        return f"vLLM exited with code {code}"
