"""Reward functions: loading by name / import path / file path, the builtins, the weighted sum,
and every failure mode turned into a RewardFailure with its reason."""

from __future__ import annotations

import threading

import anyio
import pytest

from grpod.config import RewardFunctionConfig
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.rewards import (
    RewardFailure,
    RewardFunction,
    RewardLoadError,
    last_number,
    load_reward_functions,
    score_group,
    step_reward_metrics,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def _functions(*specs: dict) -> list[RewardFunction]:
    return load_reward_functions([RewardFunctionConfig(**spec) for spec in specs])


async def _score(functions, completions, timeout_s=5.0, **columns):
    n = len(completions)
    return await score_group(
        functions, ["q"] * n, completions, [[1, 2]] * n, {k: [v] * n for k, v in columns.items()}, timeout_s
    )


async def test_math_builtin_accepts_a_latex_gold_answer_for_a_decimal_completion():
    result = await _score(_functions({"function": "math"}), ["so it is 0.5", "it is 0.25", "no idea"],
                          answer="\\boxed{\\frac{1}{2}}")
    assert result.scores == [1.0, 0.0, 0.0]


async def test_exact_and_last_number_builtins():
    exact = await _score(_functions({"function": "exact"}), [" 42\n", "42.0", "x42"], answer="42")
    assert exact.scores == [1.0, 0.0, 0.0]
    last = await _score(_functions({"function": "last_number"}), ["3 + 39 = 42", "42.0", "42 then 7", "none"], answer="42")
    assert last.scores == [1.0, 1.0, 0.0, 0.0]
    assert last_number("total: 1,234.5 apples") == 1234.5
    assert last_number("it is -7") == -7


async def test_regex_format_builtin_uses_the_functions_pattern():
    functions = _functions({"function": "regex_format", "pattern": r"<answer>\d+</answer>$"})
    result = await _score(functions, ["think... <answer>12</answer>", "<answer>x</answer>"])
    assert result.scores == [1.0, 0.0]


async def test_functions_combine_as_a_weighted_sum_and_none_counts_zero(tmp_path):
    module = tmp_path / "user_rewards.py"
    module.write_text(
        "def partial(prompts, completions, completion_ids, answer, **kw):\n"
        "    return [None if c == 'skip' else 2.0 for c in completions]\n"
    )
    functions = _functions(
        {"function": "exact", "weight": 0.5},
        {"function": f"{module}:partial", "weight": 0.25},
    )
    result = await _score(functions, ["7", "8", "skip"], answer="7")
    assert result.scores == [0.5 * 1 + 0.25 * 2, 0.25 * 2, 0.0]
    # A function's mean excludes the completions it did not apply to.
    assert result.means == {"exact": pytest.approx(1 / 3), "partial": 2.0}


async def test_columns_arrive_as_lists_one_entry_per_completion(tmp_path):
    module = tmp_path / "spy.py"
    module.write_text(
        "SEEN = {}\n"
        "def spy(prompts, completions, completion_ids, **columns):\n"
        "    SEEN.update(prompts=prompts, completions=completions, ids=completion_ids, columns=columns)\n"
        "    return [1.0] * len(completions)\n"
    )
    (function,) = _functions({"function": f"{module}:spy"})
    await _score([function], ["a", "b"], answer="1", topic="sums")
    seen = function.fn.__globals__["SEEN"]
    assert seen["prompts"] == ["q", "q"] and seen["completions"] == ["a", "b"] and seen["ids"] == [[1, 2], [1, 2]]
    assert seen["columns"] == {"answer": ["1", "1"], "topic": ["sums", "sums"]}


def test_a_function_is_loaded_by_module_path():
    (function,) = _functions({"function": "grpod.rollouts.rewards:exact_reward", "name": "mine"})
    assert function.name == "mine" and function.fn.__name__ == "exact_reward"


def test_unloadable_functions_are_load_errors_naming_the_spec(tmp_path):
    with pytest.raises(RewardLoadError, match="no file"):
        _functions({"function": f"{tmp_path}/absent.py:f"})
    with pytest.raises(RewardLoadError, match="cannot import 'no_such_pkg_xyz.mod'"):
        _functions({"function": "no_such_pkg_xyz.mod:f"})
    (tmp_path / "m.py").write_text("x = 1\n")
    with pytest.raises(RewardLoadError, match="no callable 'f'"):
        _functions({"function": f"{tmp_path}/m.py:f"})


def _user(tmp_path, body: str) -> list[RewardFunction]:
    module = tmp_path / "bad_rewards.py"
    module.write_text("import math, time\n" + body)
    return _functions({"function": f"{module}:bad"})


@pytest.mark.parametrize(
    ("body", "reason", "detail"),
    [
        ("def bad(prompts, completions, completion_ids, **kw):\n    raise KeyError('gold')\n", "reward_error", "KeyError"),
        ("def bad(prompts, completions, completion_ids, **kw):\n    return [math.nan] * len(completions)\n", "reward_nan", "nan"),
        ("def bad(prompts, completions, completion_ids, **kw):\n    return [math.inf] * len(completions)\n", "reward_nan", "inf"),
        ("def bad(prompts, completions, completion_ids, **kw):\n    return [1.0]\n", "reward_bad_length", "1 rewards for 3"),
        ("def bad(prompts, completions, completion_ids, **kw):\n    return ['1'] * len(completions)\n", "reward_bad_type", "'1'"),
        ("def bad(prompts, completions, completion_ids, **kw):\n    return 1.0\n", "reward_bad_type", "float"),
    ],
)
async def test_each_failure_mode_is_a_reward_failure_with_its_reason(tmp_path, body, reason, detail):
    with pytest.raises(RewardFailure) as failure:
        await _score(_user(tmp_path, body), ["a", "b", "c"])
    assert failure.value.reason == reason
    assert failure.value.function == "bad"
    assert detail in str(failure.value)


async def test_a_hung_function_times_out_and_is_abandoned(tmp_path):
    release = threading.Event()
    functions = _user(tmp_path, "def bad(prompts, completions, completion_ids, **kw):\n    EVENT.wait(30)\n    return [1.0]\n")
    functions[0].fn.__globals__["EVENT"] = release
    try:
        with anyio.fail_after(10):  # the source stops waiting after reward_timeout_s, not 30 s
            with pytest.raises(RewardFailure) as failure:
                await _score(functions, ["a"], timeout_s=0.2)
        assert failure.value.reason == "reward_timeout"
    finally:
        release.set()


def test_step_metrics_average_each_functions_group_means():
    def group(means):
        return RolloutGroup(tokens=[[1]], loss_mask=[[1]], scores=[0.0], extra={"reward_means": means} if means else {})

    metrics = step_reward_metrics([group({"a": 1.0, "b": 0.0}), group({"a": 0.0}), group(None)])
    assert metrics == {"reward/a": 0.5, "reward/b": 0.0}
