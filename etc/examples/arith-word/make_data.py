"""Write the arith-word example task: short arithmetic word problems with an integer `answer`.

    python etc/examples/arith-word/make_data.py [OUT_DIR]   # -> train.jsonl (2000 rows), eval.jsonl (100)

OUT_DIR defaults to this directory.

Deterministic (seeded); the two files share no question. Each row is
{"prompt": "...", "answer": "12"}; etc/examples/smollm2-dataset.toml trains on train.jsonl with
the correctness reward in rewards.py and evaluates on eval.jsonl.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 2026
TRAIN_ROWS, EVAL_ROWS = 2000, 100
NAMES = ("Ana", "Ben", "Carla", "Dev", "Emma", "Femi", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lena")
THINGS = ("apples", "books", "coins", "pens", "shells", "stickers", "cards", "marbles", "cups", "eggs")


def problem(rng: random.Random) -> tuple[str, int]:
    name, other = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?", a + b
    if kind == 1:
        a = rng.randint(10, 60)
        b = rng.randint(1, a - 1)
        return f"{name} had {a} {thing} and gave {b} to {other}. How many {thing} does {name} have left?", a - b
    if kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 12)
        return f"{name} buys {a} boxes with {b} {thing} in each. How many {thing} is that?", a * b
    if kind == 3:
        b, q = rng.randint(2, 9), rng.randint(2, 10)
        return f"{name} shares {b * q} {thing} equally among {b} friends. How many does each friend get?", q
    a, b, c = rng.randint(5, 30), rng.randint(2, 20), rng.randint(1, 5)
    return f"{name} has {a} {thing}, finds {b} more, then loses {c}. How many {thing} are left?", a + b - c


def main(out: Path = HERE) -> None:
    rng = random.Random(SEED)
    seen: dict[str, int] = {}
    while len(seen) < TRAIN_ROWS + EVAL_ROWS:
        question, answer = problem(rng)
        seen.setdefault(question, answer)
    items = list(seen.items())
    for name, rows in (("eval.jsonl", items[:EVAL_ROWS]), ("train.jsonl", items[EVAL_ROWS:])):
        with open(out / name, "w") as f:
            for question, answer in rows:
                f.write(json.dumps({"prompt": question, "answer": str(answer)}) + "\n")
        print(f"{out / name}: {len(rows)} rows")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
