"""What the sources that sample their own groups through the supervised vLLM share (builtin,
dataset): one request of `group_size` completions per prompt, the drop-not-crash rule for a
failed request, the group record, and the fill / run loops that feed the rollout buffer.

A subclass sets `cfg`, `src` (cfg.source), `bridge`, `max_tokens`, `stats` (a `SourceStats`)
and `dynamic_sampling`, and implements `generate_group()` (None = no group this time: dropped,
or the source is finished, `finished` then true).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from grpod.inference.client import Completion
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.group import RolloutGroup

log = structlog.get_logger(__name__)

# After a failed generation (vLLM restarting or dead), wait this long before the next request.
GENERATION_RETRY_S = 0.5


@dataclass
class SourceStats:
    generated: int = 0
    dropped: int = 0
    drop_reasons: dict[str, int] = field(default_factory=dict)
    generation_s: float = 0.0
    # Dynamic sampling (source.dynamic_sampling): zero-variance groups not queued, and those
    # queued anyway after too many in a row.
    dynamic_filtered: int = 0
    dynamic_let_through: int = 0
    # The current unbroken run of groups the source could not deliver (generation or reward
    # failures): wall time of its first failure, its length, the last error. The daemon's source
    # alarm reads these (grpod.daemon.alarms.SourceErrorAlarm); a delivered group ends the run.
    failing_since: float | None = None
    consecutive_errors: int = 0
    last_error: str | None = None

    def drop(self, reason: str) -> None:
        self.dropped += 1
        self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + 1

    def failed(self, reason: str, error: str) -> None:
        """A group lost to a failure: dropped, and part of the current run of failures."""
        self.drop(reason)
        self.last_error = error[:300]
        self.consecutive_errors += 1
        if self.failing_since is None:
            self.failing_since = time.time()

    def delivered(self) -> None:
        self.failing_since = None
        self.consecutive_errors = 0


class SamplingSource:
    kind = "sampling"
    # A finite source sets this once it has nothing more to give; `run` then returns.
    finished = False

    async def generate_group(self) -> RolloutGroup | None:
        raise NotImplementedError

    async def sample(self, prompt: list[int], **context: Any) -> tuple[list[Completion], int] | None:
        """`group_size` completions of `prompt` and the policy version they were sampled under
        (the older one if a sync landed meanwhile), or None: the failure is counted and logged
        with `context`, and the next request waits GENERATION_RETRY_S."""
        started = anyio.current_time()
        try:
            client = await self.bridge.wait_available(self.cfg.inference.start_timeout_s)
            version = self.bridge.policy_version
            completions = await client.generate(
                prompt,
                n=self.src.group_size,
                max_tokens=self.max_tokens,
                temperature=self.src.temperature,
                top_p=self.src.top_p,
                model=self.bridge.request_model(),
            )
        except Exception as exc:  # noqa: BLE001 — a failed generation drops its group, never the run
            self.stats.failed(type(exc).__name__, f"generation: {type(exc).__name__}: {exc}")
            log.warning("generation_failed", **context, error=str(exc)[:300], bridge_state=self.bridge.state)
            await anyio.sleep(GENERATION_RETRY_S)
            return None
        self.stats.generation_s += anyio.current_time() - started
        return completions, min(version, self.bridge.policy_version)

    def group(
        self,
        prompt: list[int],
        completions: list[Completion],
        scores: list[float],
        version: int,
        group_id: str,
        extra: dict[str, Any] | None = None,
    ) -> RolloutGroup:
        """The group record of `completions` of `prompt` (counted as generated)."""
        self.stats.generated += 1
        self.stats.delivered()
        return RolloutGroup(
            tokens=[prompt + list(c.token_ids) for c in completions],
            loss_mask=[[0] * len(prompt) + [1] * len(c.token_ids) for c in completions],
            scores=scores,
            inference_logprobs=[[0.0] * len(prompt) + [float(x) for x in c.logprobs] for c in completions],
            truncated=[c.finish_reason == "length" for c in completions],
            temperature=self.src.temperature,
            top_p=self.src.top_p,
            policy_version=version,
            source=self.kind,
            group_id=group_id,
            extra=extra or {},
        )

    async def fill(self, buffer: RolloutBuffer, count: int) -> None:
        """Generate `count` groups concurrently into `buffer` (the synchronous loop's path)."""
        async with anyio.create_task_group() as tg:
            for _ in range(count):
                tg.start_soon(self._one_into, buffer)

    async def _one_into(self, buffer: RolloutBuffer) -> None:
        group = await self.generate_group()
        if group is not None and self.dynamic_sampling.admit(group, self.stats):
            await buffer.put(group)

    async def run(self, buffer: RolloutBuffer, may_generate) -> None:
        """Keep the buffer topped up with `source.concurrency` requests in flight (overlap mode);
        returns only once the source is `finished`.

        `may_generate` is awaited before each request: the supervisor uses it for pause and drain.
        """

        async def worker() -> None:
            while not self.finished:
                await may_generate()
                await self._one_into(buffer)

        async with anyio.create_task_group() as tg:
            for _ in range(self.src.concurrency):
                tg.start_soon(worker)
