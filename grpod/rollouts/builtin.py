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

import structlog

from grpod.config import BuiltinSourceConfig
from grpod.inference.policy import Policy
from grpod.rollouts.arithmetic import (
    INSTRUCT_MIN_TOKENS,
    ArithmeticTask,
    Problem,
    prompt_style_for,
)
from grpod.rollouts.dynamic_sampling import DynamicSampling
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.held_out import play_rows
from grpod.rollouts.sampling_source import SamplingSource, SamplingStats

log = structlog.get_logger(__name__)


class BuiltinSource(SamplingSource):
    kind = "builtin"

    def __init__(
        self,
        src: BuiltinSourceConfig,
        tokenizer,
        policy: Policy,
        *,
        engine_wait_s: float,
        dynamic_sampling: DynamicSampling,
        cursor: dict | None = None,
        progress: bool = True,
    ) -> None:
        """`engine_wait_s`: how long a request waits for an available engine."""
        self.src = src
        self.tokenizer = tokenizer
        self.policy = policy
        self.engine_wait_s = engine_wait_s
        style = prompt_style_for(tokenizer, src.task_prompt) if tokenizer is not None else "bare"
        self.task = ArithmeticTask(seed=src.task_seed, prompt_style=style)
        self.max_tokens = self.src.max_tokens
        if style == "instruct" and self.max_tokens < INSTRUCT_MIN_TOKENS:
            # A chat model writes "a + b = c" before the answer: 8 tokens would cut every answer off.
            self.max_tokens = INSTRUCT_MIN_TOKENS
            log.warning("instruct_completion_budget", configured=self.src.max_tokens, used=self.max_tokens)
            if progress:
                print(
                    f"grpod: source.max_tokens = {self.src.max_tokens} is too short for an instruct model's answer; "
                    f"the arithmetic task uses {self.max_tokens} (set source.max_tokens to choose)",
                    file=sys.stderr, flush=True,
                )
        self.next_index = int((cursor or {}).get("next_index", 0))
        self.stats = SamplingStats()
        self.dynamic_sampling = dynamic_sampling

    def cursor(self) -> dict:
        return {"kind": self.kind, "next_index": self.next_index}

    def problem_at(self, index: int) -> Problem:
        """The stream's `index`-th problem: a function of source.task_seed and the index alone."""
        return self.task.sample(random.Random(f"{self.src.task_seed}:{index}"))

    def _draw(self) -> tuple[int, Problem]:
        index = self.next_index
        self.next_index += 1
        return index, self.problem_at(index)

    async def generate_group(self) -> RolloutGroup | None:
        index, problem = self._draw()
        prompt = self.task.prompt_for(self.tokenizer, problem)
        sampled = await self.sample(prompt, index=index)
        if sampled is None:
            return None
        scores = [self.task.score(problem, completion.text) for completion in sampled.completions]
        return self.group(prompt, sampled, scores, f"builtin-{index}")

    async def evaluate(self, size: int, max_tokens: int) -> dict:
        if self.task.prompt_style == "instruct":
            max_tokens = max(max_tokens, self.max_tokens)
        return await evaluate_greedy(
            self.policy, self.tokenizer, self.task, self.task.eval_set(size), max_tokens, self.engine_wait_s
        )


async def evaluate_greedy(
    policy: Policy, tokenizer, task: ArithmeticTask, problems: list[Problem], max_tokens: int, engine_wait_s: float
) -> dict:
    """Held-out accuracy of greedy decoding through vLLM (the policy the engines serve now)."""
    correct = 0
    version = policy.version

    async def one(problem: Problem) -> None:
        nonlocal correct
        async with policy.engine(engine_wait_s) as lease:
            out = await lease.client.generate(
                task.prompt_for(tokenizer, problem), n=1, max_tokens=max_tokens, temperature=0.0, model=lease.model
            )
        correct += int(task.score(problem, out[0].text) >= 1.0)

    failed = await play_rows(problems, one, where=lambda problem: f"problem {problem.id}")
    scored = len(problems) - failed
    return {"eval_accuracy": correct / max(scored, 1), "eval_size": scored, "eval_failed": failed, "policy_version": version}
