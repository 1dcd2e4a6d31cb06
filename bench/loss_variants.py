"""Loss variants on the embedded default: held-out accuracy after 100 steps and wall time.

Runs `grpod start --config etc/grpod.toml` (real vLLM, the tiny built-in model) once per
(loss type, PPO epochs, seed), changing only `train.loss.type`, `train.epochs`, the seeds and the
bookkeeping (a fresh run directory, no checkpoints). Seed N sets `run.seed = N` and
`source.task_seed = 1234 + N`; the model is the one `make model` built (seed 0) for every run,
so the seeds vary the trainer, the sampling and the problem stream, not the warm-up.

Accuracy is the daemon's own held-out evaluation (all 156 held-out problems, greedy through vLLM,
at steps 0, 20, ..., 100, from metrics.jsonl). Wall time is the whole `grpod start` process
(vLLM start-up included); training time is from the first step record to the last.

    .venv/bin/python bench/loss_variants.py [--types grpo dr_grpo cispo gspo] [--epochs 1 2]
        [--seeds 0 1 2] [--steps 100] [--out bench/results/loss_variants.json]

Each finished run is appended to the JSON file at once (a long sweep keeps what it measured);
the table at the end summarises every run in the file for the chosen variants.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from grpod.service.logs import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def run_once(loss_type: str, epochs: int, seed: int, steps: int, model: Path, workdir: Path) -> dict:
    run_dir = workdir / f"{loss_type}-e{epochs}-s{seed}"
    settings = {
        "run.dir": str(run_dir),
        "run.resume": "never",
        "run.progress": False,
        "run.seed": seed,
        "source.task_seed": 1234 + seed,
        "model.path": str(model),
        "train.steps": steps,
        "train.loss.type": loss_type,
        "train.epochs": epochs,
        "checkpoint.every": 0,
        "checkpoint.at_shutdown": False,
    }
    overrides = [f"--set={key}={json.dumps(value)}" for key, value in settings.items()]
    began = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "grpod", "start", "--config", str(ROOT / "etc" / "grpod.toml"), *overrides],
        cwd=ROOT, check=True, timeout=3600, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wall = time.monotonic() - began
    records = read_metrics(run_dir)
    evals = [r for r in records if r["kind"] == "eval"]
    steps_done = [r for r in records if r["kind"] == "step"]
    clipped = [r.get("clipped_fraction") for r in steps_done if r.get("clipped_fraction") is not None]
    return {
        "loss_type": loss_type,
        "epochs": epochs,
        "seed": seed,
        "steps": len(steps_done),
        "accuracy_start": evals[0]["eval_accuracy"],
        "accuracy_end": evals[-1]["eval_accuracy"],
        "accuracy_curve": [(e["step"], e["eval_accuracy"]) for e in evals],
        "wall_s": round(wall, 1),
        "train_s": round(steps_done[-1]["time"] - steps_done[0]["time"], 1),
        "clipped_fraction_mean": round(statistics.mean(clipped), 4) if clipped else None,
    }


def table(runs: list[dict]) -> str:
    lines = [
        "| loss | epochs | seeds | held-out accuracy start → end (per seed) | end mean | wall s (median) | training s (median) | clipped fraction (mean) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    variants = sorted({(r["loss_type"], r["epochs"]) for r in runs}, key=lambda v: (v[1], v[0]))
    for loss_type, epochs in variants:
        chosen = sorted((r for r in runs if (r["loss_type"], r["epochs"]) == (loss_type, epochs)), key=lambda r: r["seed"])
        per_seed = ", ".join(f"{r['accuracy_start']:.3f} → {r['accuracy_end']:.3f}" for r in chosen)
        clipped = [r["clipped_fraction_mean"] for r in chosen if r["clipped_fraction_mean"] is not None]
        clipped_text = f"{statistics.mean(clipped):.4f}" if clipped else "n/a"
        lines.append(
            f"| {loss_type} | {epochs} | {len(chosen)} | {per_seed} | "
            f"{statistics.mean(r['accuracy_end'] for r in chosen):.3f} | "
            f"{statistics.median(r['wall_s'] for r in chosen):.0f} | {statistics.median(r['train_s'] for r in chosen):.0f} | "
            f"{clipped_text} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", nargs="+", default=["grpo", "dr_grpo", "cispo", "gspo"])
    parser.add_argument("--epochs", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-arith")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "loss_variants.json")
    parser.add_argument("--fresh", action="store_true", help="start a new results file instead of appending")
    args = parser.parse_args()
    runs: list[dict] = [] if args.fresh or not args.out.exists() else json.loads(args.out.read_text())["runs"]
    with tempfile.TemporaryDirectory(prefix="grpod-loss-") as tmp:
        for seed in args.seeds:
            for epochs in args.epochs:
                for loss_type in args.types:
                    result = run_once(loss_type, epochs, seed, args.steps, args.model, Path(tmp))
                    runs = [r for r in runs if (r["loss_type"], r["epochs"], r["seed"]) != (loss_type, epochs, seed)]
                    runs.append(result)
                    args.out.write_text(json.dumps({"runs": runs}, indent=1))
                    print(json.dumps({k: v for k, v in result.items() if k != "accuracy_curve"}), flush=True)
    chosen = [r for r in runs if r["loss_type"] in args.types and r["epochs"] in args.epochs]
    print(table(chosen))


if __name__ == "__main__":
    main()
