"""`RewardScorer`: a dataset source's reward functions, where they run, and one call per group.

It owns the `RewardPool` its functions need (none when every function is an in-process builtin),
builds TRL's keyword arguments (`grpod.rollouts.rewards`), calls every function of a group
concurrently, and combines their rewards. `probe` is the start-up check: every function once on
the first dataset row with a placeholder completion, before vLLM is launched, so a function
written against another signature stops `grpod start` (and `grpod check-config`) in seconds.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog

from grpod.rollouts.reward_pool import PoolCallFailed, RewardPool, RewardPoolError
from grpod.rollouts.reward_worker import describe_raise
from grpod.rollouts.rewards import (
    GroupRewards,
    RewardFailure,
    RewardFunction,
    RewardLoadError,
    TrainerState,
    checked_rewards,
    combine,
    function_means,
    resolve_function,
)

log = structlog.get_logger(__name__)

# What the start-up probe scores: a completion no task expects, so a function must cope with it.
PLACEHOLDER_COMPLETION = "0"
# A function failing its probe with these is written against another call or environment: the
# start stops. Anything else it raises on the placeholder is only reported.
FATAL_AT_PROBE = ("TypeError", "ImportError", "ModuleNotFoundError", "NameError", "AttributeError")


def default_workers() -> int:
    """Reward workers when `source.dataset.reward_workers` is unset: one per core, 2 to 8."""
    return max(2, min(8, os.cpu_count() or 2))


@dataclass(frozen=True)
class RewardCall:
    """One group's keyword arguments, as TRL builds them."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]]
    trainer_state: TrainerState

    def kwargs(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts, "completions": self.completions, "completion_ids": self.completion_ids,
            "trainer_state": self.trainer_state, **self.columns,
        }


class RewardScorer:
    def __init__(
        self,
        functions: list[RewardFunction],
        *,
        aggregation: str,
        timeout_s: float,
        workers: int | None,
        memory_mb: int,
        log_path: Path | None = None,
    ) -> None:
        self.functions = functions
        self.aggregation = aggregation
        self.timeout_s = timeout_s
        pooled = [f for f in functions if not f.in_process]
        self.pool = None
        if pooled:
            self.pool = RewardPool(
                [f.spec() for f in functions], workers=workers or default_workers(), timeout_s=timeout_s,
                memory_mb=memory_mb, log_path=log_path,
            )
        self._in_process = {i: resolve_function(f.function, f.pattern) for i, f in enumerate(functions) if f.in_process}

    async def start(self) -> None:
        """Start the workers (they import the functions); RewardLoadError when they cannot."""
        if self.pool is not None:
            try:
                await self.pool.start()
            except RewardPoolError as exc:
                raise RewardLoadError(str(exc)) from None

    async def aclose(self) -> None:
        if self.pool is not None:
            await self.pool.aclose()

    def describe(self) -> dict[str, Any] | None:
        return self.pool.describe() if self.pool is not None else None

    async def _call(self, index: int, call: RewardCall) -> tuple[list[float | None], dict[str, float]]:
        function = self.functions[index]
        if index in self._in_process:
            try:
                returned = self._in_process[index](**call.kwargs())
            except Exception as exc:  # noqa: BLE001 — e.g. a row without the column it reads
                raise RewardFailure("reward_error", function.name, describe_raise(exc), type(exc).__name__) from None
            return checked_rewards(function.name, returned, len(call.completions)), {}
        try:
            return await self.pool.call(index, call.kwargs())
        except PoolCallFailed as failure:
            raise RewardFailure(failure.reason, function.name, failure.detail, failure.exc_type) from None

    async def score(self, call: RewardCall) -> GroupRewards:
        """Every function on one group (concurrently), combined; RewardFailure if one fails."""
        results: list[tuple[list[float | None], dict[str, float]] | None] = [None] * len(self.functions)
        failures: list[RewardFailure] = []

        async def one(index: int) -> None:
            try:
                results[index] = await self._call(index, call)
            except RewardFailure as failure:
                failures.append(failure)

        async with anyio.create_task_group() as tg:
            for index in range(len(self.functions)):
                tg.start_soon(one, index)
        if failures:
            raise failures[0]
        per_function = [rewards for rewards, _ in results]
        logged: dict[str, list[float]] = {}
        for _, metrics in results:
            for key, value in metrics.items():
                logged.setdefault(key, []).append(value)
        scores = combine(per_function, [f.weight for f in self.functions], self.aggregation)
        overflowed = [i for i, score in enumerate(scores) if score is not None and not math.isfinite(score)]
        if overflowed:  # each reward is finite (checked_rewards); their weighted sum passed float's range
            names = ", ".join(f.name for f in self.functions)
            raise RewardFailure("reward_nan", names, f"the combined score of completion {overflowed[0]} is "
                                f"{scores[overflowed[0]]}: the weighted {self.aggregation} of its rewards passed float's range")
        return GroupRewards(
            scores=scores,
            means=function_means(self.functions, per_function),
            logged={key: sum(values) / len(values) for key, values in logged.items()},
        )

    async def probe(self, calls: list[tuple[RewardCall, str]]) -> list[str]:
        """Every function once on each `(call, where)` (the first training row, the first held-out
        row, each with a placeholder completion): RewardLoadError naming the function, the row and
        what it expected when it is written for another call. Other exceptions on the placeholder
        are only warned of: one warning per function, naming its file, each row it raised on and
        the line that raised."""
        warnings = []
        for index, function in enumerate(self.functions):
            raised: dict[str, list[str]] = {}  # what it raised -> where (one line when both rows raise alike)
            for call, where in calls:
                try:
                    await self._call(index, call)
                except RewardFailure as failure:
                    fatal = failure.reason in ("reward_bad_type", "reward_bad_length", "reward_timeout", "reward_crash")
                    if fatal or failure.exc_type in FATAL_AT_PROBE:
                        # A wrong signature or return is the TRL contract's business; a timeout or a crash is not.
                        contract = "" if failure.reason in ("reward_timeout", "reward_crash") else (
                            ". grpod calls it as TRL does: f(prompts=..., completions=..., completion_ids=..., "
                            "trainer_state=..., <dataset columns>..., **kwargs) returning one float or None per completion")
                        raise RewardLoadError(
                            f"reward function {function.name!r} ({function.where}) failed its start-up call on {where} "
                            f"with a placeholder completion: {failure.detail}{contract}"
                        ) from None
                    raised.setdefault(failure.detail, []).append(where)
            if raised:
                said = "; ".join(f"on {' and on '.join(wheres)}: {detail}" for detail, wheres in raised.items())
                warnings.append(f"reward function {function.name!r} ({function.where}) raised on the placeholder "
                                f"completion {PLACEHOLDER_COMPLETION!r} {said} (a group whose call raises is dropped "
                                f"as reward_error; the traceback is in the reward workers' log: rewards.log, "
                                f"stderr at check-config)")
        return warnings
