"""Reward functions of the dataset source: loading them, calling them safely, combining them.

Signature (TRL's convention, so a reward function written for TRL's GRPOTrainer works here):

    f(prompts, completions, completion_ids, **columns) -> list[float | None]

one call per group: `prompts[i]` is the prompt text the model saw (after the chat template),
`completions[i]` the text of completion `i`, `completion_ids[i]` its token ids, and every other
dataset column arrives as a keyword whose value is a list with the row's value repeated once per
completion (`answer=["42", "42", ...]`). A function should accept `**kwargs` for columns it does
not use. It returns one reward per completion; `None` means "does not apply to this completion"
and counts as 0 in the combination.

Combination: the score of completion `i` is the weighted sum over the functions of
`weight * reward_i` (None → 0).

Failures never crash the daemon. A function that raises, runs past `reward_timeout_s`, returns
something that is not a list of numbers, the wrong number of rewards, or NaN / infinity makes
the whole group fail with a `RewardFailure` whose `reason` is one of `REWARD_FAILURE_REASONS`;
the source drops the group and counts the reason. Each call runs in a worker thread
(`anyio.to_thread.run_sync` with `abandon_on_cancel=True`) under `anyio.fail_after`: a function
that hangs is abandoned — its thread keeps running in the background until it returns (Python
cannot kill a thread), but the source stops waiting for it.

Builtins (by name in `function`): `math` (math-verify: the completion's final answer equals the
`answer` column, so "0.5" matches "\\boxed{\\frac{1}{2}}"), `exact` (the stripped completion
equals the stripped `answer`), `last_number` (the last number in the completion equals `answer`
numerically), `regex_format` (1.0 when the completion matches the function's `pattern`, else 0).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio

from grpod.config import RewardFunctionConfig

# What `SourceStats.drop` counts when a reward function fails, by failure.
REWARD_FAILURE_REASONS = ("reward_error", "reward_timeout", "reward_bad_type", "reward_bad_length", "reward_nan")
# Builtins that read the gold answer from this column.
ANSWER_COLUMN = "answer"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardLoadError(Exception):
    """A reward function named in the config cannot be imported."""


class RewardFailure(Exception):
    """One reward function failed on one group; `reason` is what the dropped group is counted as."""

    def __init__(self, reason: str, function: str, detail: str) -> None:
        super().__init__(f"reward function {function!r}: {detail}")
        self.reason = reason
        self.function = function
        self.detail = detail


@dataclass(frozen=True)
class RewardFunction:
    name: str
    weight: float
    fn: Callable[..., Any]
    # Dataset columns the function cannot do without (checked on every row at start-up).
    needs_columns: tuple[str, ...] = ()


@dataclass(frozen=True)
class GroupRewards:
    scores: list[float]
    # Per function: the mean of the rewards it gave (None excluded); absent when all were None.
    means: dict[str, float]


# ---- builtins -------------------------------------------------------------------------------


def _answers(columns: dict[str, list]) -> list[Any]:
    answers = columns.get(ANSWER_COLUMN)
    if answers is None:
        raise KeyError(f"this builtin needs an {ANSWER_COLUMN!r} column")
    return answers


def math_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    """1.0 when math-verify finds the completion's answer equal to the gold `answer`, else 0.0."""
    from math_verify import parse, verify

    rewards = []
    for completion, answer in zip(completions, _answers(columns), strict=True):
        # math-verify's own timeout uses signal.alarm, which only works on the main thread; the
        # source's reward_timeout_s bounds the call instead.
        gold = parse(str(answer), parsing_timeout=None)
        given = parse(completion, parsing_timeout=None)
        rewards.append(1.0 if gold and given and verify(gold, given, timeout_seconds=None) else 0.0)
    return rewards


def exact_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    """1.0 when the stripped completion equals the stripped `answer`, else 0.0."""
    answers = _answers(columns)
    return [1.0 if c.strip() == str(a).strip() else 0.0 for c, a in zip(completions, answers, strict=True)]


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def last_number(text: str) -> float | None:
    """The last number written in `text` ("1,234" and "-3.5" included), or None."""
    found = _NUMBER.findall(text)
    return _number(found[-1]) if found else None


def last_number_reward(prompts, completions, completion_ids, **columns) -> list[float]:
    """1.0 when the last number in the completion equals `answer` numerically, else 0.0."""
    rewards = []
    for completion, answer in zip(completions, _answers(columns), strict=True):
        given, gold = last_number(completion), _number(str(answer).strip())
        rewards.append(1.0 if given is not None and gold is not None and math.isclose(given, gold, abs_tol=1e-9) else 0.0)
    return rewards


def regex_format_reward(prompts, completions, completion_ids, *, pattern: str, **columns) -> list[float]:
    """1.0 when the completion matches `pattern` (re.search, DOTALL), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [1.0 if compiled.search(c) else 0.0 for c in completions]


BUILTINS: dict[str, Callable[..., Any]] = {
    "math": math_reward,
    "exact": exact_reward,
    "last_number": last_number_reward,
    "regex_format": regex_format_reward,
}


# ---- loading --------------------------------------------------------------------------------


def import_function(spec: str) -> Callable[..., Any]:
    """The callable `spec` names: "package.module:attr" or "path/to/file.py:attr"."""
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py") or "/" in target:
        path = Path(target)
        if not path.is_file():
            raise RewardLoadError(f"reward function {spec!r}: no file {path} (relative paths start at {Path.cwd()})")
        module_name = f"grpod_rewards_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            try:
                loader_spec.loader.exec_module(module)
            except Exception as exc:  # noqa: BLE001 — any import-time error is the user's to see
                raise RewardLoadError(f"reward function {spec!r}: importing {path} failed: {exc!r}") from exc
            sys.modules[module_name] = module
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:  # noqa: BLE001
            raise RewardLoadError(f"reward function {spec!r}: cannot import {target!r}: {exc!r}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardLoadError(f"reward function {spec!r}: {target} has no callable {attr!r}")
    return fn


def load_reward_functions(configs: list[RewardFunctionConfig]) -> list[RewardFunction]:
    functions = []
    for cfg in configs:
        if cfg.function in BUILTINS:
            fn = BUILTINS[cfg.function]
            if cfg.pattern is not None:
                fn = partial(fn, pattern=cfg.pattern)
            needs = (ANSWER_COLUMN,) if cfg.function in ("math", "exact", "last_number") else ()
        else:
            fn, needs = import_function(cfg.function), ()
        functions.append(RewardFunction(name=cfg.metric_name, weight=cfg.weight, fn=fn, needs_columns=needs))
    return functions


# ---- calling --------------------------------------------------------------------------------


def checked_rewards(name: str, returned: Any, n: int) -> list[float | None]:
    """`returned` as `n` floats or Nones, or a RewardFailure saying what is wrong with it."""
    if isinstance(returned, (str, bytes, dict)) or not hasattr(returned, "__len__") or not hasattr(returned, "__iter__"):
        raise RewardFailure("reward_bad_type", name, f"returned {type(returned).__name__}, expected a list of {n} floats")
    values = list(returned)
    if len(values) != n:
        raise RewardFailure("reward_bad_length", name, f"returned {len(values)} rewards for {n} completions")
    rewards: list[float | None] = []
    for i, value in enumerate(values):
        if value is None:
            rewards.append(None)
            continue
        if not isinstance(value, numbers.Real):
            raise RewardFailure("reward_bad_type", name, f"reward {i} is {value!r} ({type(value).__name__}), not a number")
        value = float(value)
        if not math.isfinite(value):
            raise RewardFailure("reward_nan", name, f"reward {i} is {value}")
        rewards.append(value)
    return rewards


async def call_reward(
    function: RewardFunction,
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list],
    timeout_s: float,
) -> list[float | None]:
    """One function on one group, in a worker thread, bounded by `timeout_s` (then abandoned)."""
    call = partial(function.fn, prompts, completions, completion_ids, **columns)
    try:
        with anyio.fail_after(timeout_s):
            returned = await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
    except TimeoutError:
        raise RewardFailure("reward_timeout", function.name, f"no result after {timeout_s} s (its thread is abandoned)") from None
    except Exception as exc:  # noqa: BLE001 — the user's code may raise anything; the group is dropped
        raise RewardFailure("reward_error", function.name, f"raised {exc!r}") from exc
    return checked_rewards(function.name, returned, len(completions))


async def score_group(
    functions: list[RewardFunction],
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list],
    timeout_s: float,
) -> GroupRewards:
    """The weighted sum of every function's rewards (None counts 0), and each function's mean."""
    scores = [0.0] * len(completions)
    means: dict[str, float] = {}
    for function in functions:
        rewards = await call_reward(function, prompts, completions, completion_ids, columns, timeout_s)
        applied = [r for r in rewards if r is not None]
        if applied:
            means[function.name] = sum(applied) / len(applied)
        for i, reward in enumerate(rewards):
            if reward is not None:
                scores[i] += function.weight * reward
    return GroupRewards(scores=scores, means=means)


# Where a dataset group keeps its functions' means (RolloutGroup.extra), for `step_reward_metrics`.
EXTRA_KEY = "reward_means"


def step_reward_metrics(groups) -> dict[str, float]:
    """`reward/<name>`: each function's mean reward over a step's groups that carry one."""
    sums: dict[str, list[float]] = {}
    for group in groups:
        for name, mean in (group.extra or {}).get(EXTRA_KEY, {}).items():
            sums.setdefault(name, []).append(mean)
    return {f"reward/{name}": sum(values) / len(values) for name, values in sorted(sums.items())}
