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

Difficulty levels (`--level max_digits=1 --level max_digits=2,min_digits=2 ...`, easiest first):
`--size` training rows per level, each with a `level` column (0, 1, ...) that
`source.dataset.curriculum` reads; the held-out rows come from `--eval-level` (default the last).
`--exclude FILE` keeps the questions of a JSONL file (another task's held-out rows) out of both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grpod.rollouts.rewards import REASONING_GYM_COLUMN


# Level i's rows are drawn with seed + LEVEL_SEED_STEP * i, apart from the seeds any level tops up with.
LEVEL_SEED_STEP = 10_007


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


def _rows_outside(name: str, size: int, seed: int, options: dict[str, Any], seen: set[str], *,
                  distinct: bool) -> list[dict[str, Any]]:
    """`size` rows whose question is not in `seen`, from draws with `seed`, then seed + 1, ...:
    the first draw's rows in order (all `size` of them when none is in `seen`); with `distinct`,
    the first draw is twice as large and no row repeats another. ValueError when the task has no
    more such questions."""
    rows: list[dict[str, Any]] = []
    taken = set(seen)
    draw_seed, count = seed, 2 * size if distinct else size
    while len(rows) < size:
        before = len(rows)
        for row in make_rows(name, count, draw_seed, options):
            if len(rows) < size and row["prompt"] not in seen and not (distinct and row["prompt"] in taken):
                rows.append(row)
                taken.add(row["prompt"])
        if len(rows) == before:
            raise ValueError(f"reasoning-gym task {name!r} with {options}: no more questions outside the "
                             f"{len(seen)} already taken")
        draw_seed, count = draw_seed + 1, 2 * size
    return rows


def parse_level(text: str) -> dict[str, Any]:
    """A `--level` value: KEY=VALUE pairs separated by commas outside brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "{": 1, "]": -1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parse_options([part for part in parts if part.strip()])


def excluded_prompts(paths: list[Path]) -> set[str]:
    """The `prompt` values of dataset files (`grpod.rollouts.dataset.read_rows`: JSONL, Parquet,
    CSV); ValueError naming a file or row that cannot be used."""
    from grpod.rollouts.dataset import DatasetError, read_rows

    prompts: set[str] = set()
    for path in paths:
        try:
            rows = read_rows(Path(path))
        except DatasetError as exc:
            raise ValueError(f"--exclude {exc}") from None
        for number, row in enumerate(rows, 1):
            if not isinstance(row.get("prompt"), str):
                raise ValueError(f"--exclude {path}: row {number}: no string `prompt`")
            prompts.add(row["prompt"])
    return prompts


def write_task(name: str, out: Path, *, size: int, eval_size: int, seed: int, options: dict[str, Any],
               levels: list[dict[str, Any]] | None = None, eval_level: int = -1,
               exclude: set[str] | None = None) -> dict:
    """DIR/train.jsonl and DIR/eval.jsonl; what was written (paths and row counts).

    `levels`: difficulty levels, each options over `options`: `size` training rows per level (level i
    drawn with seed + LEVEL_SEED_STEP * i), each row's `level` column its index, for source.dataset.curriculum; the
    held-out rows come from level `eval_level` (default the last, the hardest). `exclude`: questions
    never written (another split's held-out rows)."""
    excluded = set(exclude or ())
    train: list[dict[str, Any]] = []
    for i, extra in enumerate(levels or [{}]):
        rows = _rows_outside(name, size, seed + LEVEL_SEED_STEP * i, {**options, **extra}, excluded, distinct=False)
        if levels:
            for row in rows:
                row["level"] = i
        train.extend(rows)
    # Another seed; distinct questions, none of them a training one.
    eval_options = {**options, **(levels[eval_level] if levels else {})}
    held_out = _rows_outside(name, eval_size, seed + 1_000_003, eval_options,
                             excluded | {row["prompt"] for row in train}, distinct=True) if eval_size else []
    if levels:
        level = range(len(levels))[eval_level]
        for row in held_out:
            row["level"] = level
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for split, rows in (("train", train), ("eval", held_out)):
        path = out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        written[split] = {"path": str(path), "rows": len(rows)}
    return written
