"""`Policy`: the policy being trained, as the parts that sample it see it.

Sources, evaluations and the metrics exporter get this handle, never the bridge or the daemon:
- `version`: the newest policy version the trainer published (a sync's version once an engine
  serves it);
- `served_name`: the model name requests must use to get that policy (`policy`, or in LoRA modes
  the current adapter's name);
- `engine(timeout_s)`: an engine to sample from, the available one with the fewest outstanding
  requests (a request stays on the engine it was lent), waiting at the engines' availability
  gates while none is open;
- `endpoint()`: where environments outside grpod reach the policy (vLLM's URL and model names);
- `trainer_step`: the optimizer steps the trainer has taken (the step loop sets it after each
  step): what reward functions get as TRL's `global_step`, which counts steps, not syncs.

The bridge is the only writer of the version and the name (`publish`, after each sync).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

from grpod.inference.engine import (
    EngineLease,
    InferenceEngine,
    InferenceUnavailable,
)
from grpod.inference.routes import SERVED_MODEL_NAME
from grpod.service.race import first_of


class Policy:
    def __init__(self, engines: list[InferenceEngine], *, version: int = 0, lora: bool = False) -> None:
        if not engines:
            raise ValueError("a policy needs at least one engine")
        self.engines = engines
        self.version = version
        self.served_name = SERVED_MODEL_NAME
        self.lora = lora
        self.trainer_step = 0

    def publish(self, version: int, served_name: str | None = None) -> None:
        """The bridge's one call: `version` is the policy from now on, sampled as `served_name`."""
        self.version = version
        if served_name is not None:
            self.served_name = served_name

    @property
    def available(self) -> bool:
        return any(engine.available for engine in self.engines)

    async def _pick(self, timeout_s: float) -> InferenceEngine:
        try:
            with anyio.fail_after(timeout_s):
                while True:
                    open_engines = [e for e in self.engines if e.available]
                    if open_engines:
                        return min(open_engines, key=lambda e: e.outstanding)
                    await first_of(*(engine.wait_open for engine in self.engines))
        except TimeoutError:
            states = ", ".join(f"{e.name} {'running' if e.process.running else 'down'}" for e in self.engines)
            raise InferenceUnavailable(f"no vLLM engine available for {timeout_s:.0f} s ({states})") from None

    @asynccontextmanager
    async def engine(self, timeout_s: float) -> AsyncIterator[EngineLease]:
        """Lend the available engine with the fewest outstanding requests for one request
        (InferenceUnavailable after `timeout_s` with none open)."""
        chosen = await self._pick(timeout_s)
        async with chosen.lease(self.served_name) as lease:
            yield lease

    def endpoint(self) -> dict[str, Any] | None:
        """vLLM's OpenAI base URL, its `/generate` URL and the model names it serves (first
        running engine; None while none runs)."""
        running = [e for e in self.engines if e.process.running]
        if not running:
            return None
        process = running[0].process
        return {
            "base_url": f"{process.base_url}/v1",
            "generate_url": f"{process.base_url}/generate",
            "model_names": process.served_model_names(lora=self.lora),
            "fixed_port": process.fixed_port != 0,
            "engines": [f"{e.process.base_url}" for e in running],
        }
