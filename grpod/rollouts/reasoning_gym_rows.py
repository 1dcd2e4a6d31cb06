"""A reasoning-gym task as dataset-source files: `grpod reasoning-gym NAME --out DIR`.

reasoning-gym (PyPI `reasoning-gym`) generates procedural problems with their own verifier. This
writes DIR/train.jsonl and DIR/eval.jsonl, one row per problem: `prompt` (the question), `answer`
(the gold answer) and `reasoning_gym` (the whole entry as JSON: what the task's own verifier reads).
The builtin reward `reasoning_gym` (`grpod.rollouts.rewards`) scores a completion with that verifier:
the text of its last `<answer>...</answer>`, or the whole completion when it has none (the
verifier then gives the partial credit it gives to an answer buried in text).

The evaluation rows are drawn with another seed; they are distinct questions, none of them a
training question. Options of the task's config (`--option num_terms=4`) are passed to
`reasoning_gym.create_dataset`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpod.rollouts.rewards import REASONING_GYM_COLUMN


def _value(text: str) -> Any:
    """A `--option` value: JSON when it parses (numbers, lists, booleans), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_options(assignments: list[str]) -> dict[str, Any]:
    options = {}
    for assignment in assignments:
        key, sep, value = assignment.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--option {assignment!r}: expected KEY=VALUE")
        options[key.strip()] = _value(value.strip())
    return options


def make_rows(name: str, size: int, seed: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    """`size` rows of task `name` drawn with `seed` (ValueError naming a bad task or option)."""
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("reasoning-gym is not installed: pip install 'grpod[reasoning-gym]'") from None
    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **options)
    except (ValueError, TypeError, AssertionError) as exc:
        raise ValueError(f"reasoning-gym task {name!r} with {options}: {exc}") from None
    return [
        {"prompt": entry["question"], "answer": str(entry["answer"]), REASONING_GYM_COLUMN: json.dumps(entry, default=list)}
        for entry in dataset
    ]


def write_task(name: str, out: Path, *, size: int, eval_size: int, seed: int, options: dict[str, Any]) -> dict:
    """DIR/train.jsonl and DIR/eval.jsonl; what was written (paths and row counts)."""
    train = make_rows(name, size, seed, options)
    seen = {row["prompt"] for row in train}
    held_out: list[dict[str, Any]] = []
    draw_seed = seed + 1_000_003
    while len(held_out) < eval_size:  # another seed; distinct questions, none of them a training one
        before = len(held_out)
        for row in make_rows(name, 2 * eval_size, draw_seed, options):
            if len(held_out) < eval_size and row["prompt"] not in seen:
                held_out.append(row)
                seen.add(row["prompt"])
        if len(held_out) == before:
            raise ValueError(f"reasoning-gym task {name!r}: no question outside the {size} training rows")
        draw_seed += 1
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, rows in (("train", train), ("eval", held_out)):
        path = out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        written[split] = {"path": str(path), "rows": len(rows)}
    return written
