"""The calculator environment (`source.environment.adapter = "calculator"`, grpod's own): arithmetic
word problems the model may solve with a calculator tool (`CalculatorAdapter`), one
`CalculatorEnvironment` per episode.

The model may call a calculator by writing `<tool>expression</tool>` in its turn; the environment
answers with the value as a `tool` message, and the episode goes on. A turn without a call is the
model's final answer: the episode ends, and its reward is 1.0 when the last integer that turn
writes is the task's `answer`, else 0.0, plus `tool_bonus` (an adapter argument, default 0.0) when
the episode made at least one call the calculator could evaluate. An episode cut off before any
final answer scores only its bonus.

Tasks. Task `index` of a split is drawn from a generator seeded by (`task_seed`, split, index):
one of a few two-step word problems with operands up to 99, answers exact integers. The problem
space is split once by a hash of the question (about one in five is held out for "eval"), so
evaluation never measures a problem training saw, whatever the seeds.

The expression is evaluated without `eval`: only integers, `+ - * / // %`, unary signs and
parentheses, at most `MAX_EXPRESSION_CHARS` characters, so a model cannot run code or make the
daemon compute a huge power (a product has at most as many digits as its factors together: every
value stays below 10^200, which a float division takes). A malformed expression is answered `error: ...`, as a tool would.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import random
import re
from pathlib import Path
from typing import Any

from grpod.rollouts.chat_turns import Message
from grpod.rollouts.environments import Split

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

    def __init__(self, answer: int, tool_bonus: float = 0.0) -> None:
        self.answer = answer
        self.tool_bonus = tool_bonus
        self.final: str | None = None
        self.calls = 0
        self.good_calls = 0

    async def respond(self, text: str) -> list[Message] | None:
        calls = TOOL_CALL.findall(text)
        if not calls:
            self.final = text
            return None
        self.calls += 1
        try:
            result = calculate(calls[-1])
            self.good_calls += 1
        except CalculationError as exc:
            result = f"error: {exc}"
        return [{"role": "tool", "content": result}]

    async def reward(self) -> float:
        found = _INTEGER.findall(self.final or "")
        correct = 1.0 if found and int(found[-1]) == self.answer else 0.0
        return correct + (self.tool_bonus if self.good_calls else 0.0)

    async def aclose(self) -> None:
        pass


SYSTEM_PROMPT = (
    "You solve arithmetic word problems. You have a calculator: to use it, write <tool>expression</tool>, "
    "for example <tool>12*7+3</tool>, and stop; its result comes back to you. When you know the answer, "
    "write: Answer: <number>"
)
HELD_OUT_MODULUS = 5
_PEOPLE = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana")
# (question template, answer) with operands a, b, c: every answer an exact integer.
_TEMPLATES = (
    ("{p} has {a} coins and earns {b} coins a day for {c} days. How many coins does {p} have then?",
     lambda a, b, c: a + b * c),
    ("A box holds {a} pens. {p} buys {c} boxes and gives away {b} pens. How many pens does {p} have left?",
     lambda a, b, c: a * c - b),
    ("{p} reads {a} pages a day for {c} days, then {b} more pages. How many pages does {p} read in all?",
     lambda a, b, c: a * c + b),
    ("A farm has {a} rows of {c} trees, and {b} trees are cut down. How many trees are left?",
     lambda a, b, c: a * c - b),
)


def _held_out(question: str) -> bool:
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") % HELD_OUT_MODULUS == 0


def word_problem(seed: int, split: Split, index: int) -> tuple[str, int]:
    """Task `index` of `split`: a question and its integer answer (module docstring)."""
    rng = random.Random(f"{seed}:{split}:{index}")
    while True:
        template, answer = rng.choice(_TEMPLATES)
        a, b, c = rng.randint(11, 99), rng.randint(2, 30), rng.randint(2, 9)
        if a * c - b < 0:
            continue
        question = template.format(p=rng.choice(_PEOPLE), a=a, b=b, c=c)
        if _held_out(question) == (split == "eval"):
            return question, answer(a, b, c)


class CalculatorAdapter:
    """grpod's calculator environment as an `EnvironmentAdapter`: in process, nothing to start.
    `args`: `tool_bonus` (float, default 0.0)."""

    name = "calculator"

    def __init__(self, cfg, *, run_dir: Path | None = None) -> None:
        unknown = set(cfg.args) - {"tool_bonus"}
        if unknown:
            raise ValueError(f"source.environment.args: the calculator takes tool_bonus only, not {sorted(unknown)}")
        self.seed = cfg.task_seed
        self.tool_bonus = float(cfg.args.get("tool_bonus", 0.0))

    async def __aenter__(self) -> CalculatorAdapter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        pass

    async def open(self, index: int, split: Split) -> tuple[list[Message], CalculatorEnvironment]:
        question, answer = word_problem(self.seed, split, index)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        return messages, CalculatorEnvironment(answer, self.tool_bonus)

    def health(self) -> dict[str, Any]:
        return {}
