"""The builtin verifiable-reward task: small integer arithmetic (`37+45=` → `82`, `12-40=` → `-28`).

A problem is one operator (`+` or `-`) and two operands in `0..max_operand`. The question is the
expression followed by `=`; the policy answers with the decimal digits (a leading `-` when
negative) and then the end-of-turn token `<|im_end|>`, so a completion is 2–5 tokens with the
character tokenizer of `grpod.models.tiny`.

Held-out split. The problem space is split once, by a hash of the question text that does not
depend on any seed: about one problem in five is held out. `sample` never returns a held-out
problem and `eval_set` returns only held-out ones, so evaluation never measures a problem the
policy was warmed up or trained on, whatever seeds the warm-up and the run use. The task seed only
chooses which held-out problems `eval_set(n)` returns, and in which order.

Reward. `score` gives 1.0 for the exact answer and `format_reward` (0.0 unless configured) for a
well-formed but wrong integer; anything else scores 0.0. With the default, the mean score of a set
of completions is their accuracy.

Two prompt styles. `bare` (grpod's tiny model, character tokenizer): the question `37+45=` as the
user turn, and the completion must be exactly the answer. `instruct` (a real chat model): the
user turn asks "What is 37 + 45? Answer with the number only." and the answer is extracted: the
last integer in the completion. Measured on SmolLM2-135M-Instruct (greedy): it answers "17 + 25 =
32." or "The answer is 16.", about 11 tokens, never a bare number; exact matching scored it 0.000
and trained nothing. `prompt_style_for` picks `bare` for a character-level vocabulary (grpod's
tiny tokenizer has about 70 entries; a real model's BPE has thousands) and `instruct` otherwise.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing transformers costs ~0.8 s at start-up
    from transformers import PreTrainedTokenizerBase

END_OF_TURN = "<|im_end|>"
OPERATORS = ("+", "-")
# One problem in HELD_OUT_MODULUS is held out for evaluation.
HELD_OUT_MODULUS = 5
_INTEGER = re.compile(r"-?\d+")
PROMPT_STYLES = ("bare", "instruct")
# At most this many tokens: a character-level vocabulary (the `bare` style's tokenizer).
CHARACTER_VOCAB_MAX = 256
# An instruct model writes "a + b = c." before it stops (~11 SmolLM2 tokens): the least
# completion budget that leaves room for the answer.
INSTRUCT_MIN_TOKENS = 24


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    id: str


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def is_held_out(question: str) -> bool:
    """Whether `question` belongs to the evaluation side of the split (seed-independent)."""
    return _hash("grpod-arithmetic-split:" + question) % HELD_OUT_MODULUS == 0


def make_problem(a: int, operator: str, b: int) -> Problem:
    if operator == "+":
        value = a + b
    elif operator == "-":
        value = a - b
    else:
        raise ValueError(f"unsupported operator {operator!r}: use one of {OPERATORS}")
    question = f"{a}{operator}{b}="
    return Problem(question=question, answer=str(value), id=f"arith:{a}{operator}{b}")


def prompt_ids(tokenizer: PreTrainedTokenizerBase, problem: Problem) -> list[int]:
    """The prompt tokens: the question as one user turn, then the opened assistant turn."""
    messages = [{"role": "user", "content": problem.question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def prompt_style_for(tokenizer: PreTrainedTokenizerBase, configured: str = "auto") -> str:
    """`configured` unless it is "auto": then `bare` for a character-level vocabulary, else `instruct`."""
    if configured != "auto":
        return configured
    return "bare" if len(tokenizer) <= CHARACTER_VOCAB_MAX else "instruct"


def instruct_question(problem: Problem) -> str:
    a, operator, b = re.fullmatch(r"(\d+)([+-])(\d+)=", problem.question).groups()
    return f"What is {a} {operator} {b}? Answer with the number only."


def instruct_prompt_ids(tokenizer: PreTrainedTokenizerBase, problem: Problem) -> list[int]:
    messages = [{"role": "user", "content": instruct_question(problem)}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def extracted_answer(completion_text: str) -> str | None:
    """The last integer a completion writes (an instruct model's answer), or None."""
    found = _INTEGER.findall(completion_answer(completion_text))
    return found[-1] if found else None


def answer_ids(tokenizer: PreTrainedTokenizerBase, problem: Problem) -> list[int]:
    """The ideal completion tokens: the answer then the end-of-turn token (the eos)."""
    return tokenizer.encode(problem.answer + END_OF_TURN, add_special_tokens=False)


def completion_answer(completion_text: str) -> str:
    """The answer a completion gives: its text without the trailing end-of-turn token and blanks."""
    text = completion_text.strip()
    if text.endswith(END_OF_TURN):
        text = text[: -len(END_OF_TURN)].rstrip()
    return text


def score(problem: Problem, completion_text: str, format_reward: float = 0.0) -> float:
    """1.0 for the exact answer, `format_reward` for another well-formed integer, else 0.0."""
    given = completion_answer(completion_text)
    if given == problem.answer:
        return 1.0
    if _INTEGER.fullmatch(given):
        return format_reward
    return 0.0


class ArithmeticTask:
    """Training problems from `sample`, held-out evaluation problems from `eval_set`.

    `max_operand` bounds both operands (inclusive); the default of 19 with `+` and `-` gives
    800 problems, 156 of them held out. (Two-digit operands up to 99 proved too hard for the tiny
    model to reach a useful accuracy within a warm-up of a few seconds.)
    """

    name = "arithmetic"

    def __init__(
        self,
        seed: int,
        *,
        max_operand: int = 19,
        operators: tuple[str, ...] = OPERATORS,
        format_reward: float = 0.0,
        prompt_style: str = "bare",
    ) -> None:
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        unknown = [op for op in operators if op not in OPERATORS]
        if unknown or not operators:
            raise ValueError(f"operators must be a non-empty subset of {OPERATORS}, got {operators!r}")
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"format_reward must be in [0, 1), got {format_reward}")
        if prompt_style not in PROMPT_STYLES:
            raise ValueError(f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")
        self.prompt_style = prompt_style
        self.seed = seed
        self.max_operand = max_operand
        self.operators = tuple(operators)
        self.format_reward = format_reward

    def sample(self, rng: random.Random) -> Problem:
        """A uniformly drawn training problem (never a held-out one); consumes `rng` only."""
        while True:
            a = rng.randint(0, self.max_operand)
            operator = rng.choice(self.operators)
            b = rng.randint(0, self.max_operand)
            problem = make_problem(a, operator, b)
            if not is_held_out(problem.question):
                return problem

    @cached_property
    def _held_out(self) -> list[Problem]:
        problems = [
            make_problem(a, op, b)
            for op in self.operators
            for a in range(self.max_operand + 1)
            for b in range(self.max_operand + 1)
        ]
        held_out = [p for p in problems if is_held_out(p.question)]
        held_out.sort(key=lambda p: _hash(f"grpod-arithmetic-eval:{self.seed}:{p.question}"))
        return held_out

    @property
    def held_out_size(self) -> int:
        return len(self._held_out)

    def eval_set(self, n: int) -> list[Problem]:
        """The first `n` held-out problems in this seed's order; the same list on every call."""
        available = self.held_out_size
        if not 0 <= n <= available:
            raise ValueError(
                f"eval_set({n}): the held-out split has {available} problems with max_operand="
                f"{self.max_operand}; ask for at most {available} or raise max_operand"
            )
        return self._held_out[:n]

    prompt_ids = staticmethod(prompt_ids)
    answer_ids = staticmethod(answer_ids)

    def prompt_for(self, tokenizer: PreTrainedTokenizerBase, problem: Problem) -> list[int]:
        """The prompt tokens of `problem` in this task's prompt style."""
        if self.prompt_style == "instruct":
            return instruct_prompt_ids(tokenizer, problem)
        return prompt_ids(tokenizer, problem)

    def score(self, problem: Problem, completion_text: str) -> float:
        if self.prompt_style == "instruct":
            return 1.0 if extracted_answer(completion_text) == problem.answer else 0.0
        return score(problem, completion_text, self.format_reward)
