"""Reward functions: TRL's calling convention (keywords, conversational data, async functions,
None), the builtins, the two aggregations, the start-up probe, and every failure mode turned into
a RewardFailure with its reason. The functions run in a real `RewardPool` (worker processes)."""

from __future__ import annotations

import math
from pathlib import Path

import anyio
import pytest

from grpod.config import RewardFunctionConfig
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.rewards import (
    RewardFailure,
    RewardLoadError,
    TrainerState,
    checked_rewards,
    combine,
    import_function,
    last_number,
    reward_functions,
    step_reward_metrics,
)
from grpod.rollouts.scoring import RewardCall, RewardScorer

pytestmark = pytest.mark.anyio

# A reward module written exactly as TRL's documentation writes them (keyword call, **kwargs,
# an async function, one answering None for some completions).
TRL_STYLE = '''
import asyncio

def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

def correct(prompts, completions, completion_ids, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

async def async_len(completions, **kwargs):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]

def only_numbers(completions, trainer_state, **kwargs):
    assert trainer_state.global_step >= 0 and trainer_state.max_steps >= 0
    return [1.0 if c.strip().isdigit() else None for c in completions]

def logs(completions, log_metric, **kwargs):
    log_metric("length", sum(len(c) for c in completions) / len(completions))
    return [0.0] * len(completions)

def spy(prompts, completions, completion_ids, **kwargs):
    return [float(len(prompts) == len(completions) and kwargs["topic"] == ["sums"] * len(completions)
                  and completion_ids[0] == [1, 2])] * len(completions)
'''


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def module(tmp_path) -> Path:
    path = tmp_path / "trl_style.py"
    path.write_text(TRL_STYLE)
    return path


def _functions(*specs: dict):
    return reward_functions([RewardFunctionConfig(**spec) for spec in specs])


def _call(completions, prompts=None, **columns) -> RewardCall:
    n = len(completions)
    return RewardCall(prompts=prompts or ["q"] * n, completions=completions, completion_ids=[[1, 2]] * n,
                      columns={k: [v] * n for k, v in columns.items()}, trainer_state=TrainerState(global_step=3, max_steps=9))


async def _score(functions, completions, *, aggregation="sum", timeout_s=5.0, prompts=None, **columns):
    scorer = RewardScorer(functions, aggregation=aggregation, timeout_s=timeout_s, workers=2, memory_mb=1024)
    await scorer.start()
    try:
        return await scorer.score(_call(completions, prompts, **columns))
    finally:
        await scorer.aclose()


async def test_a_trl_style_module_works_unchanged(module):
    functions = _functions(
        {"function": f"{module}:reward_len"}, {"function": f"{module}:correct"}, {"function": f"{module}:async_len"},
        {"function": f"{module}:only_numbers"}, {"function": f"{module}:logs"}, {"function": f"{module}:spy"},
    )
    result = await _score(functions, ["7", "eight"], answer="7", topic="sums")
    # reward_len + correct + async_len + only_numbers (None for "eight") + logs + spy
    assert result.scores == [-19 + 1 + 1 + 1 + 0 + 1, -15 + 0 + 5 + 0 + 1]
    assert result.means["only_numbers"] == 1.0  # the None is left out of the function's mean
    assert result.logged == {"length": 3.0}


async def test_trls_shipped_reward_functions_run_on_conversational_data():
    from trl.rewards import accuracy_reward, think_format_reward

    del accuracy_reward, think_format_reward  # imported above to fail loudly if TRL moved them
    functions = _functions({"function": "trl.rewards:think_format_reward"}, {"function": "trl.rewards:accuracy_reward"})
    completions = [[{"role": "assistant", "content": "<think>\nadd\n</think>\nso $\\boxed{\\frac{1}{2}}$"}],
                   [{"role": "assistant", "content": "no tags, 3"}]]
    prompts = [[{"role": "user", "content": "half?"}]] * 2
    result = await _score(functions, completions, prompts=prompts, solution="$0.5$")
    assert result.scores == [2.0, 0.0]


def test_none_is_left_out_and_an_all_none_completion_is_unscorable():
    assert combine([[1.0, None, None], [0.5, 2.0, None]], [1.0, 0.5], "sum") == [1.25, 1.0, None]


def test_normalize_then_sum_normalises_each_function_in_the_group_first():
    per_function = [[0.0, 1.0, 1.0, None], [10.0, 30.0, 20.0, 20.0]]
    scores = combine(per_function, [1.0, 2.0], "normalize_then_sum")
    first = [(r - 2 / 3) / (math.sqrt(1 / 3) + 1e-4) for r in (0.0, 1.0, 1.0)]
    second = [(r - 20.0) / (math.sqrt(200 / 3) + 1e-4) for r in (10.0, 30.0, 20.0, 20.0)]
    assert scores == pytest.approx([first[0] + 2 * second[0], first[1] + 2 * second[1], first[2] + 2 * second[2], 2 * second[3]])


def test_normalize_then_sum_takes_finite_rewards_near_floats_range():
    """A finite reward of 1e160 squared past float's range: OverflowError out of the daemon's
    scoring ended the run. It is normalised as any other (a spread of one outlier)."""
    scores = combine([[0.0, 0.0, 0.0, 1e160], [1.7e308, -1.7e308, 0.0, 0.0]], [1.0, 1.0], "normalize_then_sum")
    assert all(math.isfinite(score) for score in scores), scores
    outlier = combine([[0.0, 0.0, 0.0, 1e160]], [1.0], "normalize_then_sum")
    assert outlier == pytest.approx([-0.5, -0.5, -0.5, 1.5])  # eps is nothing at that scale


async def test_a_weighted_sum_past_floats_range_is_a_named_reward_failure(tmp_path):
    """Each reward finite, their weighted sum inf: it was rejected later as a nonfinite score
    naming no function; now it is the group's reward_nan, naming the functions."""
    from grpod.rollouts.rewards import RewardFailure

    path = tmp_path / "huge.py"
    path.write_text("def huge(completions, **kwargs):\n    return [1.7e308 for _ in completions]\n")
    functions = reward_functions([RewardFunctionConfig(function=f"{path}:huge", weight=2.0)])
    with pytest.raises(RewardFailure) as caught:
        await _score(functions, ["a", "b"])
    assert caught.value.reason == "reward_nan" and "huge" in caught.value.function, caught.value
    assert "passed float's range" in str(caught.value)


async def test_math_builtin_accepts_a_latex_gold_answer_for_a_decimal_completion():
    result = await _score(_functions({"function": "math"}), ["so it is 0.5", "it is 0.25", "no idea"],
                          answer="\\boxed{\\frac{1}{2}}")
    assert result.scores == [1.0, 0.0, 0.0]


async def test_exact_and_last_number_builtins_run_in_process():
    functions = _functions({"function": "exact"}, {"function": "last_number"})
    scorer = RewardScorer(functions, aggregation="sum", timeout_s=1.0, workers=1, memory_mb=256)
    assert scorer.pool is None  # linear-time checks: no worker needed
    exact = await scorer.score(_call([" 42\n", "42.0", "x42"], answer="42"))
    assert exact.means == {"exact": pytest.approx(1 / 3), "last_number": 1.0}  # "x42" ends in 42
    assert last_number("total: 1,234.5 apples") == 1234.5
    assert last_number("it is -7") == -7


async def test_regex_format_builtin_uses_the_functions_pattern():
    functions = _functions({"function": "regex_format", "pattern": r"<answer>\d+</answer>$"})
    result = await _score(functions, ["think... <answer>12</answer>", "<answer>x</answer>"])
    assert result.scores == [1.0, 0.0]


@pytest.mark.parametrize("function", ["regex_format", "reasoning_gym"])
async def test_a_catastrophic_regex_costs_a_worker_not_the_event_loop(function):
    # reasoning_gym's pattern (where the answer is read) runs in the worker as regex_format's does.
    functions = _functions({"function": function, "pattern": r"^(a+)+$"})
    entry = '{"question": "1 + 1 =", "answer": "2", "metadata": {"source_dataset": "chain_sum"}}'
    columns = {"reasoning_gym": entry} if function == "reasoning_gym" else {}
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        with pytest.raises(RewardFailure) as failure:
            await _score(functions, ["a" * 40 + "b"], timeout_s=0.5, **columns)
        tg.cancel_scope.cancel()
    assert failure.value.reason == "reward_timeout"
    assert ticks >= 20  # the loop kept running while the regex spun (0.5 s at least)


def test_a_function_is_loaded_by_module_path():
    assert import_function("grpod.rollouts.rewards:exact_reward").__name__ == "exact_reward"


async def test_unloadable_functions_are_load_errors_naming_the_spec(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\n")
    (tmp_path / "syntax.py").write_text("def f(:\n")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(4)\n")
    (tmp_path / "dies.py").write_text("import os\nos._exit(4)\n")  # no traceback, no output: the spec is named
    cases = {
        f"{tmp_path}/dies.py:f": rf"exited with status 4 .*loading the reward functions 'f' \({tmp_path}/dies.py:f\)",
        f"{tmp_path}/absent.py:f": "no file",
        "no_such_pkg_xyz.mod:f": r"cannot import 'no_such_pkg_xyz.mod'.*imported from grpod's working directory",
        f"{tmp_path}/m.py:f": "no callable 'f'",
        f"{tmp_path}/syntax.py:f": "SyntaxError",
        f"{tmp_path}/exits.py:f": r"SystemExit\(4\)",
    }
    for spec, expected in cases.items():
        scorer = RewardScorer(_functions({"function": spec}), aggregation="sum", timeout_s=1, workers=1, memory_mb=512)
        with pytest.raises(RewardLoadError, match=expected):
            await scorer.start()
        assert scorer.pool.pids() == []  # nothing left running


@pytest.mark.parametrize(
    ("body", "reason", "detail"),
    [
        ("def bad(completions, **kw):\n    raise KeyError('gold')\n", "reward_error", "KeyError"),
        ("def bad(completions, **kw):\n    raise SystemExit(3)\n", "reward_error", "SystemExit(3)"),
        ("def bad(completions, **kw):\n    raise KeyboardInterrupt\n", "reward_error", "KeyboardInterrupt"),
        ("def bad(completions, **kw):\n    return [math.nan] * len(completions)\n", "reward_nan", "nan"),
        ("def bad(completions, **kw):\n    return [1.0]\n", "reward_bad_length", "1 rewards for 3"),
        ("def bad(completions, **kw):\n    return ['1'] * len(completions)\n", "reward_bad_type", "'1'"),
        ("def bad(completions, **kw):\n    return 1.0\n", "reward_bad_type", "float"),
        ("def bad(completions, **kw):\n    time.sleep(60)\n", "reward_timeout", "no result after 0.5 s"),
        ("def bad(completions, **kw):\n    os._exit(9)\n", "reward_crash", "exited with status 9"),
        ("def bad(completions, **kw):\n    ctypes.string_at(0)\n", "reward_crash", "SIGSEGV"),
        ("def bad(completions, **kw):\n    x = []\n    while True:\n        x.append(bytearray(10**7))\n",
         "reward_memory", "reward_memory_mb"),
    ],
)
async def test_each_failure_mode_is_a_reward_failure_with_its_reason(tmp_path, body, reason, detail):
    module = tmp_path / "bad_rewards.py"
    module.write_text("import ctypes, math, os, time\n" + body)
    scorer = RewardScorer(_functions({"function": f"{module}:bad"}), aggregation="sum", timeout_s=0.5, workers=1,
                          memory_mb=300)
    await scorer.start()
    try:
        with anyio.fail_after(20), pytest.raises(RewardFailure) as failure:
            await scorer.score(_call(["a", "b", "c"]))
        assert failure.value.reason == reason and failure.value.function == "bad"
        assert detail in str(failure.value)
        # The pool is whole again: a worker answers the next call (and fails it the same way).
        assert len(scorer.pool.pids()) == 1
    finally:
        await scorer.aclose()
    assert scorer.pool.pids() == []


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("def f(prompts, completions, completion_ids, answer):\n    return [0.0] * len(completions)\n",
         "unexpected keyword argument 'trainer_state'"),
        ("def f(completions, **kw):\n    return 1.0\n", "returned float"),
        ("def f(completions, **kw):\n    import no_such_module_xyz\n", "No module named 'no_such_module_xyz'"),
    ],
)
async def test_the_probe_stops_a_function_written_for_another_call(tmp_path, body, expected):
    module = tmp_path / "wrong.py"
    module.write_text(body)
    scorer = RewardScorer(_functions({"function": f"{module}:f"}), aggregation="sum", timeout_s=2, workers=1, memory_mb=512)
    await scorer.start()
    try:
        with pytest.raises(RewardLoadError) as err:
            await scorer.probe([(_call(["0", "0"], answer="1"), "train.jsonl: row 1 (training set)")])
    finally:
        await scorer.aclose()
    message = str(err.value)
    assert "'f'" in message and str(module) in message and "row 1" in message and expected in message
    assert "f(prompts=..., completions=..." in message  # what grpod expected


async def test_the_probe_only_warns_when_a_function_rejects_the_placeholder(tmp_path):
    module = tmp_path / "picky.py"
    module.write_text("def f(completions, **kw):\n    return [float(int(c) / 0) for c in completions]\n")
    scorer = RewardScorer(_functions({"function": f"{module}:f"}), aggregation="sum", timeout_s=2, workers=1, memory_mb=512)
    await scorer.start()
    try:
        warnings = await scorer.probe([(_call(["0", "0"]), "train.jsonl: row 1 (training set)")])
    finally:
        await scorer.aclose()
    assert len(warnings) == 1 and "ZeroDivisionError" in warnings[0]


# A reward whose helper raises KeyError on some completions (a row the user's code did not expect).
HELPER_RAISES = '''
def lookup(parsed):
    return parsed["missing_key"]


def f(completions, **kw):
    print("scoring", len(completions))
    return [float(lookup({})) if c == "bad" else 1.0 for c in completions]
'''


async def test_a_raising_reward_leaves_its_traceback_in_the_log_and_its_line_in_the_detail(tmp_path):
    """rewards.log was empty and grpod.log said only "raised KeyError('missing_key')": nothing
    told the user which line of which file raised."""
    module, log_path = tmp_path / "helper_raises.py", tmp_path / "rewards.log"
    module.write_text(HELPER_RAISES)
    scorer = RewardScorer(_functions({"function": f"{module}:f"}), aggregation="sum", timeout_s=10, workers=1,
                          memory_mb=512, log_path=log_path)
    await scorer.start()
    try:
        assert (await scorer.score(_call(["good", "fine"]))).scores == [1.0, 1.0]
        with pytest.raises(RewardFailure) as failure:
            await scorer.score(_call(["good", "bad"]))
        written = log_path.read_text()  # written as the call failed, not only at the close
    finally:
        await scorer.aclose()
    # grpod.log's one line: what was raised, and the deepest line of the user's code (the helper's).
    assert failure.value.detail == f"raised KeyError('missing_key') at {module}:3 in lookup"
    assert "scoring 2" in written  # the function's prints, as before
    assert "reward function 'f'" in written and "raised KeyError" in written
    assert "Traceback (most recent call last)" in written
    assert f'File "{module}", line 3, in lookup' in written and f'File "{module}", line 8, in f' in written
    assert "KeyError: 'missing_key'" in written


async def test_a_reward_raising_on_every_call_writes_one_traceback_and_a_count(tmp_path):
    module, log_path = tmp_path / "always.py", tmp_path / "rewards.log"
    module.write_text("def f(completions, **kw):\n    raise ValueError('no ' + completions[0])\n")
    scorer = RewardScorer(_functions({"function": f"{module}:f"}), aggregation="sum", timeout_s=10, workers=2,
                          memory_mb=512, log_path=log_path)
    await scorer.start()
    try:
        for i in range(40):
            with pytest.raises(RewardFailure, match=rf"raised ValueError\('no {i}'\) at {module}:2 in f"):
                await scorer.score(_call([str(i)]))
    finally:
        await scorer.aclose()
    written = log_path.read_text()
    # The first in full (within 30 s no other), and at the close how many were not shown.
    assert written.count("Traceback (most recent call last)") == 1 and "ValueError: no 0" in written
    assert "reward function 'f'" in written and "raised ValueError 39 more time(s)" in written


def test_checked_rewards_takes_arrays_and_booleans_as_trl_does():
    """TRL makes a float tensor of what a function returns, so `[c == a for ...]` is a reward of
    1.0 / 0.0 there; it was refused here (`reward_bad_type`), against "a TRL module works unchanged"."""
    import numpy as np

    assert checked_rewards("f", np.array([1.0, 0.5]), 2) == [1.0, 0.5]
    assert checked_rewards("f", [True, False, None], 3) == [1.0, 0.0, None]
    assert checked_rewards("f", np.array([True, False]), 2) == [1.0, 0.0]
    assert checked_rewards("f", [np.bool_(True), np.float32(0.25)], 2) == [1.0, 0.25]
    with pytest.raises(RewardFailure, match="not a number"):
        checked_rewards("f", ["1", "0"], 2)


def test_step_metrics_average_each_functions_group_means_and_logged_values():
    def group(means, logged=None):
        extra = ({"reward_means": means} if means else {}) | ({"reward_logged": logged} if logged else {})
        return RolloutGroup(tokens=[[1]], loss_mask=[[1]], scores=[0.0], extra=extra)

    metrics = step_reward_metrics([group({"a": 1.0, "b": 0.0}, {"len": 4.0}), group({"a": 0.0}, {"len": 2.0}), group(None)])
    assert metrics == {"reward/a": 0.5, "reward/b": 0.0, "reward_log/len": 3.0}


async def test_a_call_cancelled_midway_costs_its_worker_and_the_next_call_gets_a_new_one(tmp_path):
    module = tmp_path / "slow.py"
    module.write_text("import time\ndef f(completions, **kw):\n    if completions[0] == 'slow':\n        time.sleep(60)\n"
                      "    return [1.0] * len(completions)\n")
    scorer = RewardScorer(_functions({"function": f"{module}:f"}), aggregation="sum", timeout_s=30, workers=1, memory_mb=512)
    await scorer.start()
    try:
        (first,) = scorer.pool.pids()
        with anyio.move_on_after(0.5):  # a stop arriving while the call runs
            await scorer.score(_call(["slow"]))
        assert scorer.pool.pids() == []  # killed, not left running its 60 s
        with anyio.fail_after(30):
            assert (await scorer.score(_call(["quick"]))).scores == [1.0]
        assert len(scorer.pool.pids()) == 1 and scorer.pool.pids()[0] != first
    finally:
        await scorer.aclose()
