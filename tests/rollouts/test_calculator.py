"""The scripted calculator environment: tool calls answered, anything else refused without eval,
the final answer scored."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from grpod.rollouts.calculator import CalculationError, CalculatorAdapter, CalculatorEnvironment, calculate


@pytest.mark.parametrize(
    ("expression", "value"),
    [("12 + 7", "19"), ("-(3 - 10) * 2", "14"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("17 // 5", "3"), ("17 % 5", "2")],
)
def test_calculate(expression, value):
    assert calculate(expression) == value


def test_the_largest_expression_stays_within_a_float():
    assert calculate("9" * 96 + " * " + "9" * 96 + " / 1") == "1e+192"


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("__import__('os').system('true')", "unsupported"),
        ("2 ** 100000", "unsupported"),
        ("1.5 + 1", "unsupported"),
        ("1 / 0", "division by zero"),
        ("1 +", "not an expression"),
        ("1+" * 150 + "1", "longer than 200"),
        ("9 ** 9 ** 9", "unsupported"),
        ("(" * 150 + "1" + ")" * 49, "not an expression"),  # deeper than the parser nests
        ("1 + \ud800", "not an expression"),  # no source text at all: ast.parse raised UnicodeEncodeError
        ("1\x00", "not an expression"),
    ],
)
def test_calculate_refuses_what_is_not_integer_arithmetic(expression, error):
    with pytest.raises(CalculationError, match=error):
        calculate(expression)


def test_a_calculator_episode_answers_calls_and_scores_the_final_answer():
    async def episode():
        environment = CalculatorEnvironment(answer=19)
        first = await environment.respond("let me add <tool>12 + 7</tool>")
        second = await environment.respond("<tool>1/0</tool>")
        final = await environment.respond("the answer is 19")
        return environment, first, second, final, await environment.reward()

    environment, first, second, final, reward = anyio.run(episode)
    assert first == [{"role": "tool", "content": "19"}]
    assert second == [{"role": "tool", "content": "error: division by zero"}]
    assert final is None and reward == 1.0 and environment.calls == 2

    wrong = CalculatorEnvironment(answer=19)
    assert anyio.run(wrong.respond, "it is 20") is None and anyio.run(wrong.reward) == 0.0
    cut_off = CalculatorEnvironment(answer=19)
    anyio.run(cut_off.respond, "<tool>19</tool>")
    assert anyio.run(cut_off.reward) == 0.0, "no final answer: the episode was cut off"


@pytest.mark.parametrize(
    "expression",
    ["-" * 199 + "1", "1/" * 99 + "1", "(" + "9" * 97 + "/1)*(" + "9" * 94 + "/1)", "1/(" + "9" * 98 + "-" + "9" * 97 + ")"],
)
def test_the_deepest_and_largest_expressions_are_answered(expression):
    """Whatever fits in MAX_EXPRESSION_CHARS: an answer, never an exception out of the tool."""
    assert calculate(expression)


def test_a_final_answer_of_more_digits_than_python_reads_scores_as_wrong():
    """The model's text is untrusted: int() of its last number raised past 4300 digits (the group
    was dropped as a ValueError), where the answer is simply wrong."""

    async def reward(answer: int, text: str) -> float:
        environment = CalculatorEnvironment(answer=answer)
        assert await environment.respond(text) is None
        return await environment.reward()

    assert anyio.run(reward, 19, "Answer: " + "9" * 5000) == 0.0
    assert anyio.run(reward, 19, "Answer: -" + "1" * 4301) == 0.0
    assert anyio.run(reward, 7, "Answer: " + "0" * 5000 + "7") == 1.0, "leading zeros still read as the number"
    assert anyio.run(reward, 19, "Answer: 0019") == 1.0
    assert anyio.run(reward, 0, "Answer: -0") == 1.0
    assert anyio.run(reward, 19, "Answer: 190") == 0.0


@pytest.mark.parametrize(
    "bonus", [float("nan"), float("inf"), -float("inf"), 10**400, True, "0.2", None],
    ids=["nan", "inf", "-inf", "10**400", "true", "a string", "none"],
)
def test_a_tool_bonus_that_is_not_a_finite_number_is_a_config_error(bonus):
    """A NaN bonus passed check-config and then made every group's scores non-finite."""
    cfg = SimpleNamespace(args={"tool_bonus": bonus}, task_seed=0)
    with pytest.raises(ValueError, match=r"source\.environment\.args\.tool_bonus = .*: expected a finite number"):
        CalculatorAdapter(cfg)
    assert CalculatorAdapter(SimpleNamespace(args={"tool_bonus": 1}, task_seed=0)).tool_bonus == 1.0
