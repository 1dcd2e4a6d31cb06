"""Writes train.jsonl and eval.jsonl: two-number sums as chat messages (TRL's conversational format).

    python etc/examples/trl-rewards/make_data.py etc/examples/trl-rewards
"""

import json
import random
import sys
from pathlib import Path


# Operands up to 19: what the tiny model (`make model`) is warmed up on, so that the example
# learns visibly in its 40 steps. (Up to 99 it stayed at 0.000 held-out accuracy.)
MAX_OPERAND = 19


def rows(pairs: list[tuple[int, int]]) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)} for a, b in pairs]


def main(out: Path) -> None:
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(0).shuffle(pairs)
    held_out, train = rows(pairs[:40]), rows(pairs[40:])  # no held-out sum is trained on
    for name, data in (("train.jsonl", train), ("eval.jsonl", held_out)):
        (out / name).write_text("".join(json.dumps(row) + "\n" for row in data))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
