"""Reward functions of the dataset source: loading them, calling them as TRL does, combining them.

Calling convention (TRL's `GRPOTrainer`, exactly, so a reward module written for TRL works here
unchanged): one call per group and function, by keyword only,

    f(prompts=..., completions=..., completion_ids=..., trainer_state=..., log_metric=...,
      log_extra=..., **columns) -> list[float | None]

- `prompts[i]`: the row's prompt as the dataset has it: the prompt string, or for a `messages`
  row the list of {role, content} messages (with `system_prompt` first when grpod added it);
- `completions[i]`: the text of completion `i`, or for a `messages` row (conversational data)
  `[{"role": "assistant", "content": text}]`;
- `completion_ids[i]`: its token ids (what the engine sampled);
- every other dataset column as a list with the row's value once per completion;
- `trainer_state`: a `TrainerState` with TRL's `global_step` (the optimizer steps the trainer has
  taken), `max_steps` and `epoch` (rows drawn so far over the rows of the set, a fraction as
  TRL's), plus the `policy_version` that sampled the group (versions count syncs, not steps);
- `log_metric(name, value)`: a scalar averaged into the step's `reward_log/<name>`; `log_extra`
  is accepted and ignored (TRL's completions table).
An `async def` function is awaited. A function should take `**kwargs` for what it does not use.

`None` means "this function does not apply to this completion" (TRL's semantics): it is left out
of that function's mean and contributes nothing to the completion's score; a completion every
function answers None is *unscorable*: it is left out of its group's baseline and spread and gets
advantage 0 (override `unscorable`), never a 0 that would pull the baseline down. A group with no
scorable completion is dropped (`reward_unscorable`).

Aggregation (`source.dataset.reward_aggregation`, TRL's `multi_objective_aggregation`):
- `sum` (TRL's `sum_then_normalize`): score_i = sum_k w_k r_ik over the functions that applied;
- `normalize_then_sum`: each function's rewards are first normalised in the group,
  (r_ik - mean_k) / (std_k + 1e-4) (sample std, None left out), then weighted and summed; the
  advantage estimator then normalises the sum as usual.

Where the code runs: user functions and the `math` and `regex_format` builtins run in the
daemon's `RewardPool` (worker processes: a hang is killed at `reward_timeout_s`, a crash or a
memory blow-up costs one worker and one group, never the daemon; math-verify keeps its own
timeouts there). `exact` and `last_number` are linear-time string checks and run in process.
A failed call drops the group with its reason (`REWARD_FAILURE_REASONS`).

Builtins (by name in `function`): `math` (math-verify: the completion's final answer equals the
`answer` column, so "0.5" matches "\\boxed{\\frac{1}{2}}"), `exact` (the stripped completion
equals the stripped `answer`), `last_number` (the last number in the completion equals `answer`
numerically), `regex_format` (1.0 when the completion matches the function's `pattern`, else 0),
`reasoning_gym` (the task's own verifier on the answer: the last match of `pattern` when given,
else the last <answer>...</answer>, else the whole completion).
"""

from __future__ import annotations

import importlib
import json
import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, partial
from pathlib import Path
from typing import Any

from grpod.config import ConfigError, RewardFunctionConfig
from grpod.rollouts.signal import standardized

# What `SourceStats.drop` counts when a reward function fails, by failure.
REWARD_FAILURE_REASONS = (
    "reward_error", "reward_timeout", "reward_crash", "reward_memory", "reward_overloaded",
    "reward_bad_type", "reward_bad_length", "reward_nan",
)
# A group none of whose completions any function scored.
UNSCORABLE = "reward_unscorable"
AGGREGATIONS = ("sum", "normalize_then_sum")
# Builtins that read the gold answer from this column.
ANSWER_COLUMN = "answer"
# The builtin reasoning_gym reads the task's entry (JSON) from this column.
REASONING_GYM_COLUMN = "reasoning_gym"
# Builtins that are linear-time string checks: they cannot hang, so they run in process.
IN_PROCESS_BUILTINS = ("exact", "last_number")
# The keywords a function gets besides the dataset's columns (a column may not take these names).
CALL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")
# normalize_then_sum's epsilon (TRL's).
NORMALIZE_EPS = 1e-4
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardLoadError(ConfigError):
    """A reward function named in the config cannot be imported, or fails its start-up call (an
    input error: `grpod start` and `grpod check-config` exit 2)."""


class RewardFailure(Exception):
    """One reward function failed on one group; `reason` is what the dropped group is counted as."""

    def __init__(self, reason: str, function: str, detail: str, exc_type: str = "") -> None:
        super().__init__(f"reward function {function!r}: {detail}")
        self.reason = reason
        self.function = function
        self.detail = detail
        self.exc_type = exc_type  # what user code raised, when it raised (the start-up probe reads it)


@dataclass(frozen=True)
class TrainerState:
    """What TRL hands reward functions as `trainer_state` (the fields they read), and the version."""

    global_step: int = 0
    max_steps: int = 0
    policy_version: int = 0
    epoch: float = 0.0


@dataclass(frozen=True)
class RewardFunction:
    name: str
    weight: float
    function: str  # a builtin name, "package.module:attr" or "path/to/file.py:attr"
    pattern: str | None = None
    # Dataset columns the function cannot do without (checked on every row at start-up).
    needs_columns: tuple[str, ...] = ()

    @property
    def in_process(self) -> bool:
        return self.function in IN_PROCESS_BUILTINS

    @property
    def where(self) -> str:
        """Where the user finds it: the builtin, or the file / module and attribute."""
        return "builtin" if self.function in BUILTINS else self.function

    def spec(self) -> dict[str, Any]:
        return {"name": self.name, "function": self.function, "pattern": self.pattern}


@dataclass
class GroupRewards:
    # One per completion; None = unscorable (every function answered None).
    scores: list[float | None]
    # Per function: the mean of the rewards it gave (None excluded); absent when all were None.
    means: dict[str, float]
    # What the functions logged with `log_metric`, averaged over the calls.
    logged: dict[str, float] = field(default_factory=dict)

    @property
    def unscorable(self) -> list[bool]:
        return [score is None for score in self.scores]


# ---- builtins -------------------------------------------------------------------------------


def _answers(columns: dict[str, Any]) -> list[Any]:
    answers = columns.get(ANSWER_COLUMN)
    if answers is None:
        raise KeyError(f"this builtin needs an {ANSWER_COLUMN!r} column")
    return answers


def _text(completion: Any) -> str:
    """A completion's text: itself, or the content of a conversational [{role, content}] turn."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return completion


def math_reward(completions, **columns) -> list[float]:
    """1.0 when math-verify finds the completion's answer equal to the gold `answer`, else 0.0."""
    from math_verify import parse, verify

    rewards = []
    for completion, answer in zip(completions, _answers(columns), strict=True):
        # math-verify's own timeouts (SIGALRM): this runs on a reward worker's main thread.
        gold, given = parse(str(answer)), parse(_text(completion))
        rewards.append(1.0 if gold and given and verify(gold, given) else 0.0)
    return rewards


def exact_reward(completions, **columns) -> list[float]:
    """1.0 when the stripped completion equals the stripped `answer`, else 0.0."""
    answers = _answers(columns)
    return [1.0 if _text(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answers, strict=True)]


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def last_number(text: str) -> float | None:
    """The last number written in `text` ("1,234" and "-3.5" included), or None."""
    found = _NUMBER.findall(text)
    return _number(found[-1]) if found else None


def last_number_reward(completions, **columns) -> list[float]:
    """1.0 when the last number in the completion equals `answer` numerically, else 0.0."""
    rewards = []
    for completion, answer in zip(completions, _answers(columns), strict=True):
        given, gold = last_number(_text(completion)), _number(str(answer).strip())
        rewards.append(1.0 if given is not None and gold is not None and math.isclose(given, gold, abs_tol=1e-9) else 0.0)
    return rewards


def regex_format_reward(completions, *, pattern: str, **columns) -> list[float]:
    """1.0 when the completion matches `pattern` (re.search, DOTALL), else 0.0. Backtracking: it
    runs in the reward pool, where a catastrophic pattern costs a worker, not the daemon."""
    compiled = re.compile(pattern, re.DOTALL)
    return [1.0 if compiled.search(_text(c)) else 0.0 for c in completions]


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@cache
def _reasoning_gym_verifier(task: str) -> Callable[..., float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def reasoning_gym_reward(completions, *, pattern: str | None = None, **columns) -> list[float]:
    """The reasoning-gym task's own verifier, on the answer read from the completion: the last
    match of `pattern` (its group, if it has one; "" when nothing matches), or by default the
    text of the last <answer>...</answer> (the whole completion when it has none). The entry is
    the row's `reasoning_gym` column (`grpod reasoning-gym` writes it)."""
    entries = columns.get(REASONING_GYM_COLUMN)
    if entries is None:
        raise KeyError(f"this builtin needs a {REASONING_GYM_COLUMN!r} column (grpod reasoning-gym writes it)")
    compiled = re.compile(pattern, re.DOTALL) if pattern is not None else None
    rewards = []
    for completion, raw in zip(completions, entries, strict=True):
        entry = json.loads(raw) if isinstance(raw, str) else raw
        text = _text(completion)
        if compiled is not None:
            found = compiled.findall(text)
            answer = found[-1].strip() if found else ""
        else:
            tagged = _ANSWER_TAG.findall(text)
            answer = tagged[-1].strip() if tagged else text.strip()
        verify = _reasoning_gym_verifier(entry["metadata"]["source_dataset"])
        rewards.append(float(verify(answer=answer, entry=entry)))
    return rewards


BUILTINS: dict[str, Callable[..., Any]] = {
    "math": math_reward,
    "exact": exact_reward,
    "last_number": last_number_reward,
    "regex_format": regex_format_reward,
    "reasoning_gym": reasoning_gym_reward,
}


# ---- loading --------------------------------------------------------------------------------


def missing_file(spec: str) -> None:
    """RewardLoadError when `spec` names a file ("path/to/file.py:attr") that does not exist."""
    target = spec.rpartition(":")[0]
    if (target.endswith(".py") or "/" in target) and not Path(target).is_file():
        raise RewardLoadError(f"reward function {spec!r}: no file {target} (relative paths start at {Path.cwd()})")


def import_function(spec: str) -> Callable[..., Any]:
    """The callable `spec` names: "package.module:attr" or "path/to/file.py:attr"."""
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py") or "/" in target:
        missing_file(spec)
        path = Path(target)
        module_name = f"grpod_rewards_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(module_name)
        if module is None:
            loader_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader_spec)
            try:
                loader_spec.loader.exec_module(module)
            except BaseException as exc:  # noqa: BLE001 — a SyntaxError, a raise or a sys.exit at import: the user's to see
                raise RewardLoadError(f"reward function {spec!r}: importing {path} failed: {exc!r}") from exc
            sys.modules[module_name] = module
    else:
        try:
            module = importlib.import_module(target)
        except BaseException as exc:  # noqa: BLE001
            raise RewardLoadError(f"reward function {spec!r}: cannot import {target!r}: {exc!r} (a module name is "
                                  f"imported from grpod's working directory, {Path.cwd()}; a path, 'dir/file.py:"
                                  "function', names a file anywhere)") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardLoadError(f"reward function {spec!r}: {target} has no callable {attr!r}")
    return fn


def resolve_function(function: str, pattern: str | None = None) -> Callable[..., Any]:
    """The callable of a builtin name or an import spec (what a reward worker runs)."""
    if function in BUILTINS:
        fn = BUILTINS[function]
        return partial(fn, pattern=pattern) if pattern is not None else fn
    return import_function(function)


def reward_functions(configs: list[RewardFunctionConfig]) -> list[RewardFunction]:
    """The configured functions (nothing imported here: the reward workers import them)."""
    return [
        RewardFunction(
            name=cfg.metric_name, weight=cfg.weight, function=cfg.function, pattern=cfg.pattern,
            needs_columns=(ANSWER_COLUMN,) if cfg.function in ("math", "exact", "last_number")
            else (REASONING_GYM_COLUMN,) if cfg.function == "reasoning_gym" else (),
        )
        for cfg in configs
    ]


# ---- checking and combining -----------------------------------------------------------------


def checked_rewards(name: str, returned: Any, n: int) -> list[float | None]:
    """`returned` as `n` floats or Nones, or a RewardFailure saying what is wrong with it."""
    if hasattr(returned, "tolist") and not isinstance(returned, (str, bytes)):  # numpy arrays, tensors
        returned = returned.tolist()
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
        if isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", "") == "b":  # numpy's bool too
            # TRL makes a float tensor of the rewards: True is 1.0 there.
            value = float(value)
        if not isinstance(value, numbers.Real):
            raise RewardFailure("reward_bad_type", name, f"reward {i} is {value!r:.80} ({type(value).__name__}), not a number")
        value = float(value)
        if not math.isfinite(value):
            raise RewardFailure("reward_nan", name, f"reward {i} is {value}")
        rewards.append(value)
    return rewards


def _normalized(rewards: list[float | None]) -> list[float | None]:
    """(r - mean) / (std + eps) over the rewards that are not None (sample std, TRL's nanstd),
    taken in units of their largest magnitude: a finite reward of 1e160 squared past float's range
    and raised OverflowError out of the daemon's scoring, which ended the run."""
    normalized = iter(standardized([r for r in rewards if r is not None], "sample", NORMALIZE_EPS))
    return [None if r is None else next(normalized) for r in rewards]


def combine(per_function: list[list[float | None]], weights: list[float], aggregation: str) -> list[float | None]:
    """Each completion's score from every function's rewards (see the module docstring); None
    where every function answered None."""
    if aggregation == "normalize_then_sum":
        per_function = [_normalized(rewards) for rewards in per_function]
    elif aggregation != "sum":
        raise ValueError(f"unknown reward aggregation {aggregation!r}: use one of {AGGREGATIONS}")
    scores: list[float | None] = []
    for i in range(len(per_function[0]) if per_function else 0):
        applied = [(w, rewards[i]) for w, rewards in zip(weights, per_function, strict=True) if rewards[i] is not None]
        scores.append(sum(w * r for w, r in applied) if applied else None)
    return scores


def function_means(functions: list[RewardFunction], per_function: list[list[float | None]]) -> dict[str, float]:
    means = {}
    for function, rewards in zip(functions, per_function, strict=True):
        applied = [r for r in rewards if r is not None]
        if applied:
            means[function.name] = sum(applied) / len(applied)
    return means


# Where a dataset group keeps its functions' means (RolloutGroup.extra), for `step_reward_metrics`.
EXTRA_KEY = "reward_means"
LOGGED_KEY = "reward_logged"


def step_reward_metrics(groups) -> dict[str, float]:
    """`reward/<name>`: each function's mean reward over a step's groups that carry one;
    `reward_log/<name>`: what the functions logged with `log_metric`, averaged likewise."""
    sums: dict[str, list[float]] = {}
    for group in groups:
        extra = group.extra or {}
        for name, mean in extra.get(EXTRA_KEY, {}).items():
            sums.setdefault(f"reward/{name}", []).append(mean)
        for name, mean in extra.get(LOGGED_KEY, {}).items():
            sums.setdefault(f"reward_log/{name}", []).append(mean)
    return {key: sum(values) / len(values) for key, values in sorted(sums.items())}
