"""vf_calculator: arithmetic word problems with a calculator tool, as a verifiers 0.4.0 environment.

Written with verifiers' own API (`verifiers.v1`), so it runs under `vf-eval` as well as in grpod
(`source.environment.adapter = "verifiers"`, `name = "vf_calculator"`, this directory's parent on
`path`). verifiers finds it by id: this package's `__all__` exports one `vf.Taskset` subclass and
one `vf.Env` subclass (`verifiers.v1.utils.loaders: taskset_class, environment_class`).

- Tasks are generated in code from `seed` (no downloads): task i is always the same problem.
- The turn protocol is plain text a small chat model (SmolLM2-135M-Instruct, ChatML) can write:
  `<tool>12 * 7</tool>` asks the calculator, whose value comes back as the next user turn
  (`<result>84</result>`); `<answer>84</answer>` ends the episode. A turn with neither is taken
  as the final answer too. At most `max_tool_calls` calls; the next one ends the episode.
- Rewards (`@vf.reward` on the task): `correct_answer` 1.0 when the last integer of the final
  reply is the answer; `answer_format` 0.1 (weight) when that reply uses `<answer>...</answer>`.
  Metric `tool_calls`.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Iterator

import verifiers.v1 as vf

SYSTEM_PROMPT = (
    "Solve the problem. You may use a calculator: write <tool>expression</tool>, for example "
    "<tool>12 * 7</tool>, and its result comes back. Give your final answer as <answer>number</answer>."
)
TOOL = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
INTEGER = re.compile(r"-?\d+")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Div: operator.truediv, ast.Mod: operator.mod}

# (question, the expression that answers it).
TEMPLATES = [
    ("{name} has {a} apples and buys {b} bags of {c} apples each. How many apples does {name} have now?",
     "{a}+{b}*{c}"),
    ("A box holds {c} pens. {name} fills {b} boxes and has {a} pens left over. How many pens are there in all?",
     "{b}*{c}+{a}"),
    ("{name} had {a} coins and gave away {b} coins to each of {c} friends. How many coins are left?",
     "{a}-{b}*{c}"),
]
# Each task opens with a worked exchange of its own template (these operands): a 135M chat model
# copies the protocol from it (without one, SmolLM2-135M-Instruct almost never calls the tool).
DEMO = {"name": "Tom", "a": 40, "b": 3, "c": 11}


def demonstration(template: str, expression: str) -> list[dict]:
    """The worked exchange: the question, the calculator call, its result, the tagged answer."""
    value = calculate(expression.format(**DEMO))
    return [
        {"role": "user", "content": template.format(**DEMO)},
        {"role": "assistant", "content": f"<tool>{expression.format(**DEMO)}</tool>"},
        {"role": "user", "content": f"<result>{value}</result>"},
        {"role": "assistant", "content": f"<answer>{value}</answer>"},
    ]


NAMES = ["Ada", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana"]


def calculate(expression: str) -> str:
    """An integer arithmetic expression's value (no `eval`), or `error: ...` as a tool answers."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**12:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only integers and + - * / // % are allowed")

    try:
        result = value(ast.parse(expression.strip()[:100], mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


class CalculatorData(vf.TaskData):
    answer: int
    """The problem's answer."""


class CalculatorTask(vf.Task[CalculatorData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct_answer(self, task: CalculatorData, trace: vf.Trace) -> float:
        reply = trace.last_reply
        found = ANSWER.findall(reply)
        numbers = INTEGER.findall(found[-1] if found else reply)
        return 1.0 if numbers and int(numbers[-1]) == task.answer else 0.0

    @vf.reward(weight=0.1)
    async def answer_format(self, trace: vf.Trace) -> float:
        return 1.0 if ANSWER.search(trace.last_reply) else 0.0

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(len(TOOL.findall(m.content or "")) > 0 for m in trace.assistant_messages))


class CalculatorConfig(vf.TasksetConfig):
    seed: int = 0
    """Seed of the problem generator."""
    size: int = 1000
    """How many problems."""


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    def load(self) -> Iterator[CalculatorTask]:
        for i in range(self.config.size):
            rng = random.Random(f"{self.config.seed}:{i}")
            template, expression = rng.choice(TEMPLATES)
            a, b, c = rng.randint(10, 99), rng.randint(2, 9), rng.randint(2, 12)
            if int(calculate(expression.format(a=a, b=b, c=c))) < 0:
                a += b * c
            question = template.format(name=rng.choice(NAMES), a=a, b=b, c=c)
            yield CalculatorTask(
                CalculatorData(
                    prompt=[*demonstration(template, expression), {"role": "user", "content": question}],
                    system_prompt=SYSTEM_PROMPT, answer=int(calculate(expression.format(a=a, b=b, c=c))),
                ),
                self.config.task,
            )


class CalculatorEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    max_tool_calls: int = 3
    """Calculator calls per episode; the next turn ends the episode."""


class CalculatorEnv(vf.Env[CalculatorEnvConfig]):
    """The calculator's side of the conversation: each reply with a `<tool>` call gets its value."""

    async def run(self, task, agents):
        async with agents.solver.interaction(task) as interaction:
            segment = await interaction.turn()
            calls = 0
            while not segment.terminated:
                expressions = TOOL.findall(segment.last_reply)
                if not expressions or ANSWER.search(segment.last_reply) or calls >= self.config.max_tool_calls:
                    break
                calls += 1
                segment = await interaction.turn(f"<result>{calculate(expressions[-1])}</result>")


def load_environment(**kwargs) -> CalculatorEnv:
    """The environment built from taskset keyword arguments (`seed`, `size`)."""
    return vf.load_environment(vf.resolve_env_config({"taskset": {"id": "vf_calculator", **kwargs}}))


__all__ = ["CalculatorEnv", "CalculatorTaskset", "load_environment"]
