"""The scripted calculator environment: tool calls answered, anything else refused without eval,
the final answer scored."""

from __future__ import annotations

import anyio
import pytest

from grpod.rollouts.calculator import CalculationError, CalculatorEnvironment, calculate


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
