"""Overlapped vs synchronous generate/train loop on the builtin task (real vLLM, CPU build).

Runs `grpod start` on the embedded default (`etc/grpod.toml`) twice — `source.overlap = false`
(generate a step's groups, then train on them) and `true` (generation runs ahead while the
trainer trains) — and
reads the steady-state step period from metrics.jsonl (wall time between consecutive steps,
first steps dropped). From the synchronous run it also derives the generate time and the train
(+ sync) time per step; the ideal overlapped period is max(generate, train). The overlapped loop
can come in under that ideal: there the sync is pipelined, and its vLLM half (reload, probe)
leaves the trainer's path, so "train + sync" of the synchronous loop overstates the trainer's
share. `--set KEY=VALUE` overrides a key in both runs.

    .venv/bin/python bench/overlap.py [--steps 16] [--model models/tiny-arith] [--set KEY=VALUE]

Prints a table and writes bench/results/overlap.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from grpod.service.logs import read_metrics

ROOT = Path(__file__).resolve().parents[1]

def run(mode_overlap: bool, model: Path, steps: int, workdir: Path, extra: list[str]) -> list[dict]:
    """One `grpod start` on the embedded default (etc/grpod.toml) with only the loop's mode, the
    run length and the bookkeeping (no evaluation, no checkpoints) changed."""
    run_dir = workdir / ("overlap" if mode_overlap else "sync")
    settings = {
        "run.dir": str(run_dir),
        "run.resume": "never",
        "run.progress": False,
        "model.path": str(model),
        "source.overlap": mode_overlap,
        "train.steps": steps,
        "train.schedule": "constant",
        "checkpoint.every": 0,
        "checkpoint.at_shutdown": False,
        "eval.size": 0,
    }
    overrides = [f"--set={key}={json.dumps(value)}" for key, value in settings.items()]
    subprocess.run(
        [sys.executable, "-m", "grpod", "start", "--config", str(ROOT / "etc" / "grpod.toml"), *overrides, *extra],
        cwd=ROOT, check=True, timeout=1800,
    )  # fmt: skip
    return [r for r in read_metrics(run_dir) if r["kind"] == "step"]


def steady(records: list[dict], skip: int) -> dict:
    times = [r["time"] for r in records]
    periods = [b - a for a, b in zip(times, times[1:], strict=False)][skip:]
    train = [r["step_s"] for r in records][skip + 1 :]
    return {
        "period_s": statistics.median(periods),
        "period_spread_s": (min(periods), max(periods)),
        "train_sync_s": statistics.median(train),
        "staleness_mean": statistics.mean(r["staleness_mean"] for r in records[skip + 1 :]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--skip", type=int, default=3, help="first step periods dropped (warm-up)")
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-arith")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one more override for both runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="grpod-bench-") as tmp:
        extra = [f"--set={kv}" for kv in args.set]
        sync = steady(run(False, args.model, args.steps, Path(tmp), extra), args.skip)
        over = steady(run(True, args.model, args.steps, Path(tmp), extra), args.skip)
    generate = sync["period_s"] - sync["train_sync_s"]
    ideal = max(generate, sync["train_sync_s"])
    result = {
        "steps": args.steps,
        "synchronous_period_s": sync["period_s"],
        "overlapped_period_s": over["period_s"],
        "generate_s": generate,
        "train_sync_s": sync["train_sync_s"],
        "ideal_period_s": ideal,
        "speedup": sync["period_s"] / over["period_s"],
        "overlapped_vs_ideal": over["period_s"] / ideal,
        "overlapped_staleness_mean": over["staleness_mean"],
        "spread": {"synchronous": sync["period_spread_s"], "overlapped": over["period_spread_s"]},
    }
    rows = [
        ("synchronous step period (s)", f"{sync['period_s']:.3f}"),
        ("  of which generate (s)", f"{generate:.3f}"),
        ("  of which train + sync (s)", f"{sync['train_sync_s']:.3f}"),
        ("overlapped step period (s)", f"{over['period_s']:.3f}"),
        ("max(generate, train) (s)", f"{ideal:.3f}"),
        ("speed-up over synchronous", f"{result['speedup']:.2f}x  (target >= 1.6x)"),
        ("overlapped / max(generate, train)", f"{result['overlapped_vs_ideal']:.2f}  (target <= 1.15)"),
        ("overlapped mean staleness", f"{over['staleness_mean']:.2f} versions"),
    ]
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"| {a:<{width}} | {b} |" for a, b in rows))
    out = ROOT / "bench" / "results" / "overlap.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
