"""The agent example's learning curve: `etc/examples/agent-calculator.toml` (SmolLM2-135M-Instruct,
calculator word problems, up to 3 turns) run by `grpod start` for `--minutes` from launch, per
seed, stopped with `grpod ctl stop`. Greedy held-out accuracy on `--eval-size` problems (the
calculator's held-out split) at the start, every `--eval-every` steps and at the stop, each with
its 95 % Wilson interval; the training reward per step; episodes/s and model tokens/s.

    .venv/bin/python bench/agent_example.py [--seeds 0,1,2] [--minutes 15] [--eval-size 100]

Seed N: `run.seed = N`, `source.environment.task_seed = 1234 + N`, a fresh run directory.
Writes bench/results/agent_example.json and prints one table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from stats import wilson
from timed import run_for

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "etc" / "examples" / "agent-calculator.toml"


def run_seed(seed: int, minutes: float, eval_size: int, eval_every: int, workdir: Path) -> dict:
    run_dir = workdir / f"seed{seed}"
    overrides = [
        f"run.dir={json.dumps(str(run_dir))}", f"run.seed={seed}", f"source.environment.task_seed={1234 + seed}",
        "train.steps=100000", f"eval.size={eval_size}", f"eval.every={eval_every}",
    ]
    timed = run_for(CONFIG, overrides, minutes, run_dir, workdir / f"seed{seed}.log")
    launched, stopped_at = timed["launched"], timed["stopped"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_s" in r]
    evals = []
    for r in records:
        if "eval_accuracy" in r:
            correct = round(r["eval_accuracy"] * r["eval_size"])
            evals.append({
                "step": r["step"], "when": r.get("when"), "minutes": round((r["time"] - launched) / 60, 2),
                "accuracy": r["eval_accuracy"], "interval": wilson(correct, r["eval_size"]), "size": r["eval_size"],
                "reward": r.get("eval_reward"),
            })
    last = steps[-1] if steps else {}
    trained_s = stopped_at - launched
    return {
        "seed": seed, "returncode": timed["returncode"], "steps": len(steps),
        "trained_steps": sum(1 for r in steps if not r.get("skipped")),
        "reward_by_step": [r.get("reward_mean") for r in steps],
        "evals": evals,
        "episodes_per_s": last.get("episodes", 0) / trained_s,
        "model_tokens_per_s": last.get("sampled_tokens", 0) / trained_s,
        "tool_calls_per_episode": last.get("env/tool_calls"),
        "minutes": minutes,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--eval-size", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=40)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="grpod-agent-") as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            results.append(run_seed(seed, args.minutes, args.eval_size, args.eval_every, Path(tmp)))
            print(json.dumps(results[-1]["evals"]), file=sys.stderr, flush=True)
    print(f"etc/examples/agent-calculator.toml, {args.minutes:g} min from launch per seed, greedy held-out "
          f"accuracy on {args.eval_size} problems (95 % Wilson interval)\n")
    print("| seed | start | each evaluation (min from launch: accuracy) | at the stop | steps (trained) | "
          "reward, first 10 → last 10 steps | episodes/s | model tokens/s | tool calls / episode |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        evals = r["evals"]

        def shown(e):
            lo, hi = e["interval"]
            return f"{e['accuracy']:.2f} [{lo:.2f}, {hi:.2f}]"

        middle = ", ".join(f"{e['minutes']:.0f}: {e['accuracy']:.2f}" for e in evals[1:-1])
        rewards = [x for x in r["reward_by_step"] if x is not None]
        first, last = rewards[:10], rewards[-10:]
        curve = f"{sum(first) / max(len(first), 1):.2f} → {sum(last) / max(len(last), 1):.2f}"
        calls = r["tool_calls_per_episode"]
        print(f"| {r['seed']} | {shown(evals[0])} | {middle or '—'} | {shown(evals[-1])} | {r['steps']} ({r['trained_steps']}) | "
              f"{curve} | {r['episodes_per_s']:.2f} | {r['model_tokens_per_s']:.1f} | "
              f"{'—' if calls is None else f'{calls:.2f}'} |")
    out = ROOT / "bench" / "results" / "agent_example.json"
    out.write_text(json.dumps({"config": str(CONFIG.relative_to(ROOT)), "results": results}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
