"""The builtin rollout source: the arithmetic task, generated through the supervised vLLM.

Each group is `source.group_size` completions of one prompt, sampled in one request (token ids
in, token ids and processed logprobs out), scored by the task's verifier and tagged with the
policy version vLLM served when the request was made (the older version wins if a sync landed
while it ran). Problems are drawn by index from a seeded stream, so the source's cursor is one
integer and a resumed run continues the stream instead of repeating it.

A group whose generation failed (vLLM restarting or dead) is dropped and counted, never
half-used; the problem is simply skipped. With `source.dynamic_sampling`, groups without signal
are not queued (`grpod.rollouts.dynamic_sampling`).
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field

import anyio
import structlog

from grpod.config import GrpodConfig
from grpod.rollouts.arithmetic import INSTRUCT_MIN_TOKENS, ArithmeticTask, Problem, prompt_style_for
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.dynamic_sampling import DynamicSampling
from grpod.rollouts.group import RolloutGroup

log = structlog.get_logger(__name__)


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
    # The current unbroken run of failed generations (the daemon's source alarm reads these).
    failing_since: float | None = None
    consecutive_errors: int = 0
    last_error: str | None = None

    def drop(self, reason: str) -> None:
        self.dropped += 1
        self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + 1

    def failed(self, reason: str, error: str) -> None:
        """A request that failed: dropped, and part of the current run of failures."""
        self.drop(reason)
        self.last_error = error
        self.consecutive_errors += 1
        if self.failing_since is None:
            self.failing_since = time.time()

    def succeeded(self) -> None:
        self.failing_since = None
        self.consecutive_errors = 0


class BuiltinSource:
    kind = "builtin"

    def __init__(self, cfg: GrpodConfig, tokenizer, bridge, *, cursor: dict | None = None) -> None:
        self.cfg = cfg
        self.src = cfg.source
        self.tokenizer = tokenizer
        self.bridge = bridge
        style = prompt_style_for(tokenizer, cfg.source.task_prompt) if tokenizer is not None else "bare"
        self.task = ArithmeticTask(seed=cfg.source.task_seed, prompt_style=style)
        self.max_tokens = self.src.max_tokens
        if style == "instruct" and self.max_tokens < INSTRUCT_MIN_TOKENS:
            # A chat model writes "a + b = c" before the answer: 8 tokens would cut every answer off.
            self.max_tokens = INSTRUCT_MIN_TOKENS
            log.warning("instruct_completion_budget", configured=self.src.max_tokens, used=self.max_tokens)
            print(
                f"grpod: source.max_tokens = {self.src.max_tokens} is too short for an instruct model's answer; "
                f"the arithmetic task uses {self.max_tokens} (set source.max_tokens to choose)",
                file=sys.stderr, flush=True,
            )
        self.next_index = int((cursor or {}).get("next_index", 0))
        self.stats = SourceStats()
        self.dynamic_sampling = DynamicSampling(cfg)

    def cursor(self) -> dict:
        return {"kind": self.kind, "next_index": self.next_index}

    def _draw(self) -> tuple[int, Problem]:
        index = self.next_index
        self.next_index += 1
        return index, self.task.sample(random.Random(f"{self.src.task_seed}:{index}"))

    async def generate_group(self) -> RolloutGroup | None:
        index, problem = self._draw()
        prompt = self.task.prompt_for(self.tokenizer, problem)
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
            self.stats.failed(type(exc).__name__, f"{type(exc).__name__}: {str(exc)[:300]}")
            log.warning("generation_failed", index=index, error=str(exc)[:300], bridge_state=self.bridge.state)
            return None
        version = min(version, self.bridge.policy_version)
        self.stats.succeeded()
        self.stats.generation_s += anyio.current_time() - started
        tokens, masks, logprobs, scores, truncated = [], [], [], [], []
        for completion in completions:
            tokens.append(prompt + list(completion.token_ids))
            masks.append([0] * len(prompt) + [1] * len(completion.token_ids))
            logprobs.append([0.0] * len(prompt) + [float(x) for x in completion.logprobs])
            scores.append(self.task.score(problem, completion.text))
            truncated.append(completion.finish_reason == "length")
        self.stats.generated += 1
        return RolloutGroup(
            tokens=tokens,
            loss_mask=masks,
            scores=scores,
            inference_logprobs=logprobs,
            truncated=truncated,
            temperature=self.src.temperature,
            top_p=self.src.top_p,
            policy_version=version,
            source=self.kind,
            group_id=f"builtin-{index}",
        )

    async def evaluate(self, size: int, max_tokens: int) -> dict:
        if self.task.prompt_style == "instruct":
            max_tokens = max(max_tokens, self.max_tokens)
        return await evaluate_greedy(self.bridge, self.tokenizer, self.task, self.task.eval_set(size), max_tokens)

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
        """Keep the buffer topped up with `source.concurrency` requests in flight (overlap mode).

        `may_generate` is awaited before each request: the supervisor uses it for pause and drain.
        """

        async def worker() -> None:
            while True:
                await may_generate()
                group = await self.generate_group()
                if group is None:
                    await anyio.sleep(0.5)
                    continue
                if self.dynamic_sampling.admit(group, self.stats):
                    await buffer.put(group)

        async with anyio.create_task_group() as tg:
            for _ in range(self.src.concurrency):
                tg.start_soon(worker)


async def evaluate_greedy(bridge, tokenizer, task: ArithmeticTask, problems: list[Problem], max_tokens: int) -> dict:
    """Held-out accuracy of greedy decoding through vLLM (the policy vLLM serves right now)."""
    client = await bridge.wait_available(60.0)
    correct = 0
    limiter = anyio.Semaphore(8)

    async def one(problem: Problem) -> None:
        nonlocal correct
        async with limiter:
            out = await client.generate(
                task.prompt_for(tokenizer, problem),
                n=1,
                max_tokens=max_tokens,
                temperature=0.0,
                model=bridge.request_model(),
            )
        correct += int(task.score(problem, out[0].text) >= 1.0)

    async with anyio.create_task_group() as tg:
        for problem in problems:
            tg.start_soon(one, problem)
    return {"eval_accuracy": correct / max(len(problems), 1), "eval_size": len(problems), "policy_version": bridge.policy_version}
