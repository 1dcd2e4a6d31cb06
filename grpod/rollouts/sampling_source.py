"""What the sources that sample their own groups through the supervised vLLM share (builtin,
dataset): one request of `group_size` completions per prompt, the drop-not-crash rule for a
failed request, the group record, the fill / run loops that feed the rollout buffer, and the
console warning of dropped groups, throttled per reason (`ThrottledWarnings`; the environment
source's too).

A subclass sets `src` (its `source` section), `policy`, `engine_wait_s`, `max_tokens`, `stats` (a
`SamplingStats`) and `dynamic_sampling`, and implements `generate_group()` (None = no group this
time: dropped, or the source is finished, `stats.exhausted` then true).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from grpod.inference.client import Completion
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.episode import Episode, episode_group
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.source import MayGenerate, SourceStats
from grpod.service.logs import RepeatThrottle

log = structlog.get_logger(__name__)

# After a failed generation (vLLM restarting or dead), wait this long before the next request.
GENERATION_RETRY_S = 0.5


@dataclass
class SamplingStats(SourceStats):
    generated: int = 0
    generation_s: float = 0.0
    # Completion tokens the engines returned for training groups, whatever became of the groups
    # (trained, dropped for zero variance or staleness, filtered): the generation throughput.
    sampled_tokens: int = 0
    # Dynamic sampling (source.dynamic_sampling): zero-variance groups not queued, and those
    # queued anyway after too many in a row.
    dynamic_filtered: int = 0
    dynamic_let_through: int = 0

    def step_metrics(self) -> dict[str, Any]:
        # Since this process started: completion tokens sampled for training (the generation
        # rate), and the groups dynamic sampling threw away (where the rest of them went).
        return {**super().step_metrics(), "sampled_tokens": self.sampled_tokens, "dynamic_filtered": self.dynamic_filtered}


class ThrottledWarnings:
    """A source's console warnings about dropped groups: one line per event and reason per
    REPEAT_EVERY_S, saying how many were not shown (a reward function or an environment failing
    on every group must not print a line per group). Only the console is throttled: the source
    counts every drop in its stats (`SourceStats.failed`), which the source alarm reads."""

    def __init__(self) -> None:
        self._throttle = RepeatThrottle()  # by (event, reason)

    def warn(self, event: str, reason: str, **fields: Any) -> None:
        held = self._throttle.admit((event, reason), anyio.current_time())
        if held is not None:
            log.warning(event, reason=reason, **fields, **({"same_failures_not_shown": held} if held else {}))


@dataclass(frozen=True)
class Sampled:
    completions: list[Completion]
    version: int  # the policy version they were sampled under
    engine: str  # the engine that sampled them


class SamplingSource:
    kind = "sampling"
    # A cancelled `fill` loses the prompts its generations drew (the cursor has passed them).
    fill_cancel_safe = False
    may_resend = False  # each group is a fresh draw: two alike (short answers, a row again) are both trained

    async def generate_group(self) -> RolloutGroup | None:
        raise NotImplementedError

    async def sample(self, prompt: list[int], **context: Any) -> Sampled | None:
        """`group_size` completions of `prompt`, the policy version they were sampled under (the
        older one if a sync landed meanwhile) and the engine that sampled them, or None: the
        failure is counted and logged with `context`, and the next request waits
        GENERATION_RETRY_S."""
        started = anyio.current_time()
        try:
            async with self.policy.engine(self.engine_wait_s) as lease:
                completions = await lease.client.generate(
                    prompt,
                    n=self.src.group_size,
                    max_tokens=self.max_tokens,
                    temperature=self.src.temperature,
                    top_p=self.src.top_p,
                    model=lease.model,
                )
                sampled = Sampled(completions, lease.sampled_version(), lease.engine.name)
        except Exception as exc:  # noqa: BLE001 — a failed generation drops its group, never the run
            self.stats.failed(type(exc).__name__, f"generation: {type(exc).__name__}: {exc}")
            log.warning("generation_failed", **context, error=str(exc)[:300])
            await anyio.sleep(GENERATION_RETRY_S)
            return None
        self.stats.generation_s += anyio.current_time() - started
        self.stats.sampled_tokens += sum(len(c.token_ids) for c in completions)
        return sampled

    def group(
        self,
        prompt: list[int],
        sampled: Sampled,
        scores: list[float],
        group_id: str,
        extra: dict[str, Any] | None = None,
        overrides: list[dict[str, Any]] | None = None,
    ) -> RolloutGroup:
        """The group record of `sampled` completions of `prompt` (counted as generated): each
        completion a one-turn episode scored by its score; its `extra` names the engine that
        sampled it; `overrides` are per completion."""
        episodes = []
        for completion, score in zip(sampled.completions, scores, strict=True):
            episode = Episode.start(prompt)
            episode.add_model_turn(completion.token_ids, completion.logprobs, sampled.version, completion.finish_reason)
            episode.reward = score
            episodes.append(episode)
        self.stats.generated += 1
        self.stats.succeeded()
        return episode_group(
            episodes,
            temperature=self.src.temperature,
            top_p=self.src.top_p,
            source=self.kind,
            group_id=group_id,
            extra={"engine": sampled.engine, **(extra or {})},
            overrides=overrides,
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

    async def run(self, buffer: RolloutBuffer, may_generate: MayGenerate) -> None:
        """Keep the buffer topped up with `source.concurrency` requests in flight (overlap mode);
        returns only once the source is exhausted.

        `may_generate` is awaited before each request: the supervisor uses it for pause and drain.
        """

        async def worker() -> None:
            while not self.stats.exhausted:
                await may_generate()
                await self._one_into(buffer)

        async with anyio.create_task_group() as tg:
            for _ in range(self.src.concurrency):
                tg.start_soon(worker)
