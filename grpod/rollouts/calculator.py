"""`CalculatorEnvironment`: a scripted tool environment for multi-turn episodes (a `TurnEnvironment`).

The model may call a calculator by writing `<tool>expression</tool>` in its turn; the environment
answers with the value as a `tool` message, and the episode goes on. A turn without a call is the
model's final answer: the episode ends, and its reward is 1.0 when the last integer that turn
writes is the task's `answer`, else 0.0. An episode cut off before any final answer scores 0.0.

The expression is evaluated without `eval`: only integers, `+ - * / // %`, unary signs and
parentheses, at most `MAX_EXPRESSION_CHARS` characters, so a model cannot run code or make the
daemon compute a huge power (a product has at most as many digits as its factors together: every
value stays below 10^200, which a float division takes). A malformed expression is answered `error: ...`, as a tool would.
"""

from __future__ import annotations

import ast
import operator
import re

from grpod.rollouts.chat_turns import Message

MAX_EXPRESSION_CHARS = 200
TOOL_CALL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_INTEGER = re.compile(r"-?\d+")
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculationError(ValueError):
    """An expression the calculator does not take (its message is the tool's answer)."""


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        try:
            return _BINARY[type(node.op)](_value(node.left), _value(node.right))
        except ZeroDivisionError:
            raise CalculationError("division by zero") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    raise CalculationError(f"unsupported: {ast.unparse(node)[:40]}")


def calculate(expression: str) -> str:
    """The value of an integer arithmetic `expression`, written as a tool answers (an integral
    value without a decimal point)."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculationError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculationError(f"not an expression: {expression.strip()[:40]}") from None
    value = _value(tree.body)
    if isinstance(value, int):
        return str(value)
    # A quotient: integral ones as integers while a float holds them exactly, others in 6 digits.
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else f"{value:.6g}"


class CalculatorEnvironment:
    """One episode of a task whose answer is the integer `answer` (module docstring)."""

    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.final: str | None = None
        self.calls = 0

    async def respond(self, text: str) -> list[Message] | None:
        calls = TOOL_CALL.findall(text)
        if not calls:
            self.final = text
            return None
        self.calls += 1
        try:
            result = calculate(calls[-1])
        except CalculationError as exc:
            result = f"error: {exc}"
        return [{"role": "tool", "content": result}]

    async def reward(self) -> float:
        found = _INTEGER.findall(self.final or "")
        return 1.0 if found and int(found[-1]) == self.answer else 0.0
