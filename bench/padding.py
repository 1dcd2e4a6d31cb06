"""Padding efficiency and trainer step time per `train.micro_batch_tokens`.

Two length mixes, 8 groups of 8 completions per step (the default `groups_per_step` and
`group_size`):

- `arithmetic`: the builtin task's real prompts (chat template + question, character tokens) with
  completions as a warmed-up policy produces them: 75 % the answer plus end-of-turn (2-5 tokens),
  25 % a wrong ramble of 2..16 tokens (16 = `source.max_tokens`, i.e. truncated).
- `generic`: prompts of 15-25 tokens, completions of 2-16 tokens, uniform.

For each budget, with and without the efficiency floor (`micro_batch_min_efficiency`): padding
efficiency (real / processed tokens) over 50 random steps, the mean micro-batch count, and the
median wall time of a real `Trainer.train_step` on the tiny model (full fine-tuning, fp32, AdamW)
over 8 steps after one warm-up step. Prints a table and writes bench/results/padding.json.

    .venv/bin/python bench/padding.py [--threads 1] [--budgets 64,128,...] [--timed-steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import structlog
import torch

from grpod.config import parse_config
from grpod.models.tiny import build_model, save_model
from grpod.rollouts.arithmetic import ArithmeticTask, answer_ids, prompt_ids
from grpod.rollouts.group import RolloutGroup
from grpod.training.batching import plan_micro_batches
from grpod.training.trainer import build_trainer

GROUPS, GROUP_SIZE, MAX_TOKENS = 8, 8, 16
RESULTS = Path(__file__).parent / "results" / "padding.json"


def arithmetic_step(rng: random.Random, task: ArithmeticTask, tokenizer) -> list[RolloutGroup]:
    groups = []
    for _ in range(GROUPS):
        problem = task.sample(rng)
        prompt = prompt_ids(tokenizer, problem)
        answer = answer_ids(tokenizer, problem)
        completions = [answer if rng.random() < 0.75 else _ramble(rng, tokenizer) for _ in range(GROUP_SIZE)]
        groups.append(_group(rng, prompt, completions))
    return groups


def generic_step(rng: random.Random, task: ArithmeticTask, tokenizer) -> list[RolloutGroup]:
    groups = []
    for _ in range(GROUPS):
        prompt = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(15, 25))]
        completions = [_ramble(rng, tokenizer) for _ in range(GROUP_SIZE)]
        groups.append(_group(rng, prompt, completions))
    return groups


def _ramble(rng: random.Random, tokenizer) -> list[int]:
    """2..MAX_TOKENS random non-special tokens."""
    return [rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(2, MAX_TOKENS))]


def _group(rng: random.Random, prompt: list[int], completions: list[list[int]]) -> RolloutGroup:
    scores = [1.0, 0.0] + [float(rng.random() < 0.5) for _ in completions[2:]]
    return RolloutGroup(
        tokens=[prompt + c for c in completions],
        loss_mask=[[0] * len(prompt) + [1] * len(c) for c in completions],
        scores=scores,
        inference_logprobs=[[0.0] * len(prompt) + [rng.uniform(-4.5, -3.5) for _ in c] for c in completions],
    )


MIXES = {"arithmetic": arithmetic_step, "generic": generic_step}


def measure(
    mix: str, settings: list[tuple[int, float]], model_dir: Path, threads: int, timed_steps: int, tokenizer, task
) -> list[dict]:
    rng = random.Random(0)
    plan_steps = [MIXES[mix](rng, task, tokenizer) for _ in range(50)]
    rows = []
    for budget, floor in settings:
        plans = [plan_micro_batches([len(t) for g in step for t in g.tokens], budget, floor) for step in plan_steps]
        train = {"micro_batch_tokens": budget, "micro_batch_min_efficiency": floor, "threads": threads, "lr": 1e-6}
        cfg = parse_config({"train": train})
        trainer = build_trainer(cfg, model_dir)
        trainer.train_step(plan_steps[0])
        times = []
        for step in plan_steps[1 : 1 + timed_steps]:
            started = time.perf_counter()
            trainer.train_step(step)
            times.append(time.perf_counter() - started)
        rows.append(
            {
                "mix": mix,
                "micro_batch_tokens": budget,
                "micro_batch_min_efficiency": floor,
                "padding_efficiency": sum(p.real_tokens for p in plans) / sum(p.processed_tokens for p in plans),
                "micro_batches": statistics.mean(len(p.batches) for p in plans),
                "real_tokens": statistics.mean(p.real_tokens for p in plans),
                "step_time_s": statistics.median(times),
                "step_time_min_s": min(times),
            }
        )
        row = rows[-1]
        print(
            f"{mix:<11} {budget:>7} {floor:>6} {row['padding_efficiency']:>9.1%} {row['micro_batches']:>8.1f} "
            f"{row['real_tokens']:>8.0f} {row['step_time_s'] * 1000:>10.1f} {row['step_time_min_s'] * 1000:>9.1f}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the trainer (0 = torch default)")
    parser.add_argument("--budgets", default="64,96,128,192,256,384,512,1024,4096")
    parser.add_argument("--floors", default="0,0.95", help="micro_batch_min_efficiency values")
    parser.add_argument("--timed-steps", type=int, default=8)
    parser.add_argument("--mixes", default="arithmetic,generic")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    settings = [(int(b), float(f)) for f in args.floors.split(",") for b in args.budgets.split(",")]

    model, tokenizer = build_model(seed=0)
    task = ArithmeticTask(seed=0)
    header = ("mix", "budget", "floor", "padding", "micro", "tokens", "median ms", "min ms")
    print("{:<11} {:>7} {:>6} {:>9} {:>8} {:>8} {:>10} {:>9}".format(*header))
    rows = []
    load = os.getloadavg()[0]  # step times on a shared machine are only as steady as its load
    with tempfile.TemporaryDirectory() as tmp:
        save_model(model, tokenizer, Path(tmp))
        for mix in args.mixes.split(","):
            rows += measure(mix, settings, Path(tmp), args.threads, args.timed_steps, tokenizer, task)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "bench": "padding",
                "groups_per_step": GROUPS,
                "group_size": GROUP_SIZE,
                "threads": args.threads or torch.get_num_threads(),
                "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "loadavg_1m": load},
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
