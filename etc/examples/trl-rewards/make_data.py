"""Writes train.jsonl and eval.jsonl: two-number sums as chat messages (TRL's conversational format).

    python etc/examples/trl-rewards/make_data.py etc/examples/trl-rewards
"""

import json
import random
import sys
from pathlib import Path


def rows(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append({"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)})
    return out


def main(out: Path) -> None:
    train, held_out = rows(0, 400), rows(1, 40)
    for name, data in (("train.jsonl", train), ("eval.jsonl", held_out)):
        (out / name).write_text("".join(json.dumps(row) + "\n" for row in data))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
