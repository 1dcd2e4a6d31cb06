"""Where the generated tokens go: the share of completion tokens that reach a gradient
(`gradient_token_share`), with and without dynamic sampling and active sampling, on
`etc/examples/reasoning-gym.toml` (SmolLM2-135M-Instruct, reasoning-gym chain_sum).

    .venv/bin/python bench/generation_share.py [--minutes 8] [--seeds 0] [--variants off,dynamic,rest]

Each variant is one `grpod start` of the example for `--minutes` from launch, stopped with
`grpod ctl stop` (which runs the end-of-run evaluation); the task's rows are written once by
`grpod reasoning-gym` (`--train-size` rows, `--eval-size` held-out questions). Variants:
- off: neither switch (every generated group is queued; the trainer drops zero-variance groups);
- dynamic: `source.dynamic_sampling = true` (groups without signal are not queued);
- rest: dynamic sampling and `source.dataset.rest_epochs = 2` (active sampling).
Reported per run: steps and trained steps, sampled completion tokens/s, gradient_token_share at
the stop, the share of groups generated that carried signal, greedy held-out accuracy at start
and at the stop with its 95 % Wilson interval. Writes bench/results/generation_share.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stats import wilson
from timed import run_for

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "etc" / "examples" / "reasoning-gym.toml"
VARIANTS = {
    "off": ["source.dynamic_sampling=false", "source.dataset.rest_epochs=0"],
    "dynamic": ["source.dynamic_sampling=true", "source.dataset.rest_epochs=0"],
    "rest": ["source.dynamic_sampling=true", "source.dataset.rest_epochs=2"],
}


def write_task(data: Path, train_size: int, eval_size: int) -> None:
    subprocess.run([sys.executable, "-m", "grpod", "reasoning-gym", "chain_sum", "--out", str(data),
                    "--size", str(train_size), "--eval-size", str(eval_size),
                    "--option", "max_terms=2", "--option", "max_digits=2"], cwd=ROOT, check=True, timeout=300)


def run(variant: str, seed: int, minutes: float, data: Path, eval_size: int, workdir: Path) -> dict:
    run_dir = workdir / f"{variant}-seed{seed}"
    overrides = [
        f"run.dir={json.dumps(str(run_dir))}", f"run.seed={seed}", f"source.dataset.shuffle_seed={seed}",
        f"source.dataset.path={json.dumps(str(data / 'train.jsonl'))}",
        f"eval.dataset={json.dumps(str(data / 'eval.jsonl'))}", f"eval.size={eval_size}", "eval.every=100000",
        "train.steps=100000", "run.record_rollouts=true", *VARIANTS[variant],
    ]
    source = (run_for(CONFIG, overrides, minutes, run_dir, workdir / f"{variant}-seed{seed}.log")["status"] or {}).get("source")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_s" in r]
    evals = [r for r in records if "eval_accuracy" in r]
    groups = [json.loads(line)["group"] for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    span = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else float("nan")
    sampled = steps[-1].get("sampled_tokens", 0) - steps[0].get("sampled_tokens", 0)

    def accuracy(r: dict) -> dict:
        correct = round(r["eval_accuracy"] * r["eval_size"])
        return {"step": r["step"], "accuracy": r["eval_accuracy"], "interval": wilson(correct, r["eval_size"])}

    return {
        "variant": variant, "seed": seed, "minutes": minutes,
        "steps": steps[-1]["step"], "trained_steps": sum(1 for r in steps if not r.get("skipped")),
        "sampled_tokens": steps[-1].get("sampled_tokens"),
        "sampled_tokens_per_s": sampled / span if span else None,
        "gradient_token_share": steps[-1].get("gradient_token_share"),
        "gradient_tokens": sum(r.get("gradient_tokens", 0) for r in steps),
        "trained_groups": len(groups),
        "trained_groups_with_signal": sum(1 for g in groups if len(set(g["scores"])) > 1),
        "source": source,
        "eval_start": accuracy(evals[0]) if evals else None,
        "eval_end": accuracy(evals[-1]) if len(evals) > 1 else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--variants", default="off,dynamic,rest")
    parser.add_argument("--train-size", type=int, default=128)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "generation_share.json")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="generation-share-", dir=ROOT / "runs"))
    data = workdir / "chain_sum"
    write_task(data, args.train_size, args.eval_size)
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for variant in args.variants.split(","):
            began = time.time()
            results.append(run(variant, seed, args.minutes, data, args.eval_size, workdir))
            results[-1]["wall_s"] = round(time.time() - began, 1)
            args.out.write_text(json.dumps({"config": str(CONFIG.relative_to(ROOT)), "runs": results}, indent=2))
    print(f"\n{args.minutes:g} minutes from launch per run, SmolLM2-135M-Instruct, chain_sum (2 terms, up to 2 digits), "
          f"{args.train_size} training rows; greedy held-out accuracy on {args.eval_size} questions (95 % Wilson)\n")
    print("| variant | seed | steps (trained) | sampled tok/s | gradient_token_share | trained groups with signal | "
          "held-out start | held-out at stop |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        def acc(e):
            return f"{e['accuracy']:.3f} [{e['interval'][0]:.3f}, {e['interval'][1]:.3f}]" if e else "-"
        print(f"| {r['variant']} | {r['seed']} | {r['steps']} ({r['trained_steps']}) | {r['sampled_tokens_per_s']:.1f} | "
              f"{r['gradient_token_share']} | {r['trained_groups_with_signal']}/{r['trained_groups']} | "
              f"{acc(r['eval_start'])} | {acc(r['eval_end'])} |")
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
