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
one of a few one- and two-step word problems with operands up to 99, answers exact integers,
opened by a system prompt that explains the tool and one worked exchange of the same template
with other operands (`demonstration`). The problem
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
import math
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
        except OverflowError:  # a quotient beyond a float's range (the length bound should prevent it)
            raise CalculationError("result too large") from None
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
    except (SyntaxError, ValueError):  # ValueError: text that is no source at all (a lone surrogate)
        raise CalculationError(f"not an expression: {expression.strip()[:40]!r}") from None
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
        correct = 1.0 if found and _same_integer(found[-1], self.answer) else 0.0
        return correct + (self.tool_bonus if self.good_calls else 0.0)

    async def aclose(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        """Calls made, and calls the calculator could not evaluate (answered `error: ...`)."""
        return {"tool_calls": float(self.calls), "tool_errors": float(self.calls - self.good_calls)}


def _same_integer(written: str, answer: int) -> bool:
    """Whether `written` (`-?\\d+`, from the model) is `answer`. A number with more digits than the
    answer is not read: `int()` refuses over 4300 digits (Python's limit) and takes quadratic time."""
    digits = written.lstrip("-").lstrip("0") or "0"
    if len(digits) > len(str(abs(answer))):
        return False
    return (-int(digits) if written.startswith("-") else int(digits)) == answer


SYSTEM_PROMPT = "You have a calculator. Write <tool>expression</tool> to use it. Then write: Answer: <number>"
HELD_OUT_MODULUS = 5
_PEOPLE = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana")
# (question, the expression that answers it) over operands a, b, c and a person p.
_TEMPLATES = (
    ("A box holds {a} pens. How many pens are in {c} boxes?", "{a}*{c}"),
    ("{p} has {a} coins and finds {b} more. How many coins does {p} have?", "{a}+{b}"),
    ("{p} has {a} coins and earns {b} coins a day for {c} days. How many coins does {p} have then?", "{a}+{b}*{c}"),
    ("A box holds {a} pens. {p} buys {c} boxes and gives away {b} pens. How many pens does {p} have left?",
     "{a}*{c}-{b}"),
    ("{p} reads {a} pages a day for {c} days, then {b} more pages. How many pages does {p} read in all?",
     "{a}*{c}+{b}"),
    ("A farm has {a} rows of {c} trees, and {b} trees are cut down. How many trees are left?", "{a}*{c}-{b}"),
)
# The worked exchange before each task uses the task's own template with these operands. Measured on
# SmolLM2-135M-Instruct (temperature 1): a system prompt alone drew a calculator call in 2 of 48
# samples; a worked exchange of another shape in 15-19 of 32; one of the question's own shape in
# 23-28 of 32 (many with the wrong operands: what training teaches).
_DEMO = {"a": 12, "b": 7, "c": 15, "p": "Tom"}


def _held_out(question: str) -> bool:
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") % HELD_OUT_MODULUS == 0


def word_problem(seed: int, split: Split, index: int) -> tuple[str, int]:
    """Task `index` of `split`: a question and its integer answer (module docstring)."""
    question, _, answer = _task(seed, split, index)
    return question, answer


def _task(seed: int, split: Split, index: int) -> tuple[str, int, int]:
    """Task `index` of `split`: its question, template and answer."""
    rng = random.Random(f"{seed}:{split}:{index}")
    while True:
        which = rng.randrange(len(_TEMPLATES))
        values = {"a": rng.randint(11, 99), "b": rng.randint(2, 30), "c": rng.randint(2, 9), "p": rng.choice(_PEOPLE)}
        question = _TEMPLATES[which][0].format(**values)
        answer = int(calculate(_TEMPLATES[which][1].format(**values)))
        if answer >= 0 and _held_out(question) == (split == "eval"):
            return question, which, answer


def demonstration(which: int) -> list[Message]:
    """A worked exchange of template `which`: the question, the calculator call, its result, the answer."""
    question, expression = _TEMPLATES[which]
    value = calculate(expression.format(**_DEMO))
    return [
        {"role": "user", "content": question.format(**_DEMO)},
        {"role": "assistant", "content": f"<tool>{expression.format(**_DEMO)}</tool>"},
        {"role": "tool", "content": value},
        {"role": "assistant", "content": f"Answer: {value}"},
    ]


class CalculatorAdapter:
    """grpod's calculator environment as an `EnvironmentAdapter`: in process, nothing to start.
    `args`: `tool_bonus` (a finite number, default 0.0)."""

    name = "calculator"

    def __init__(self, cfg, *, run_dir: Path | None = None) -> None:
        unknown = set(cfg.args) - {"tool_bonus"}
        if unknown:
            raise ValueError(f"source.environment.args: the calculator takes tool_bonus only, not {sorted(unknown)}")
        self.seed = cfg.task_seed
        self.tool_bonus = _finite_number(cfg.args, "tool_bonus", 0.0)

    async def __aenter__(self) -> CalculatorAdapter:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        pass

    async def open(self, index: int, split: Split) -> tuple[list[Message], CalculatorEnvironment]:
        question, which, answer = _task(self.seed, split, index)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, *demonstration(which), {"role": "user", "content": question}]
        return messages, CalculatorEnvironment(answer, self.tool_bonus)

    def health(self) -> dict[str, Any]:
        return {}


def _finite_number(args: dict[str, Any], key: str, default: float) -> float:
    """`args[key]` as a float, or a ValueError naming the argument (a config error: the start and
    `grpod check-config` exit 2). A NaN bonus would make every group's scores non-finite."""
    value = args.get(key, default)
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond a float's range
            pass
    if not math.isfinite(number):
        raise ValueError(f"source.environment.args.{key} = {value!r:.40}: expected a finite number")
    return number
