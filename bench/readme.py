"""The figures the README quotes for the embedded default, regenerated (issue #14 item 6).

Per seed N (default 0, 1, 2): `grpod init-model --seed N` into a fresh directory (timed), then
`grpod start --config etc/grpod.toml` on it with `run.seed = N`, `source.task_seed = 1234 + N`
and a fresh run directory (timed), as `make run` does for seed 0. From the run's own records: the
held-out greedy accuracy at the start and the end (all 156 held-out problems), launch → first
step and launch → accuracy 0.8, the start-up phases (`startup` event), steps/s over training time.
The machine's state is recorded beside the figures (load average before and after, cores): the
README says what it was when it quotes them.

    .venv/bin/python bench/readme.py [--seeds 0,1,2] [--out bench/results/readme.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpod.service.logs import read_metrics  # noqa: E402


def timed(argv: list[str]) -> float:
    began = time.monotonic()
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600)
    return time.monotonic() - began


def one_seed(seed: int, work: Path) -> dict:
    model, run_dir = work / f"model-{seed}", work / f"run-{seed}"
    build_s = timed([sys.executable, "-m", "grpod", "init-model", "--seed", str(seed), "--out", str(model)])
    launched = time.time()
    start_s = timed([
        sys.executable, "-m", "grpod", "start", "--config", str(ROOT / "etc" / "grpod.toml"),
        "--set", f"run.dir={json.dumps(str(run_dir))}", "--set", f"model.path={json.dumps(str(model))}",
        "--set", f"run.seed={seed}", "--set", f"source.task_seed={1234 + seed}",
    ])  # fmt: skip
    records = read_metrics(run_dir)
    evals = [r for r in records if r["kind"] == "eval"]
    steps = [r for r in records if r["kind"] == "step"]
    reached = next((r["time"] - launched for r in evals if r["eval_accuracy"] >= 0.8), None)
    startup = next(
        (json.loads(line) for line in (run_dir / "grpod.log").read_text().splitlines() if '"event": "startup"' in line), {}
    )
    training_s = steps[-1]["time"] - steps[0]["time"] + steps[0]["step_s"] if steps else None
    return {
        "seed": seed,
        "accuracy_start": evals[0]["eval_accuracy"],
        "accuracy_end": evals[-1]["eval_accuracy"],
        "accuracy_best": max(r["eval_accuracy"] for r in evals),
        "eval_size": evals[-1]["eval_size"],
        "model_build_s": round(build_s, 1),
        "grpod_start_s": round(start_s, 1),
        "launch_to_first_step_s": round(steps[0]["time"] - steps[0]["step_s"] - launched, 1) if steps else None,
        "launch_to_accuracy_0_8_s": round(reached, 1) if reached is not None else None,
        "steps_per_s": round(len(steps) / training_s, 2) if training_s else None,
        "startup": {k: v for k, v in startup.items() if k.endswith("_s")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "readme.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="grpod-readme-") as tmp:
        rows = [one_seed(int(seed), Path(tmp)) for seed in args.seeds.split(",")]
    machine = {"cores": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    print("| seed | start → end (best) | eval size | model build | `grpod start` | launch → first step | launch → 0.8 | steps/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['seed']} | {r['accuracy_start']:.3f} → {r['accuracy_end']:.3f} ({r['accuracy_best']:.3f}) | "
            f"{r['eval_size']} | {r['model_build_s']:.0f} s | {r['grpod_start_s']:.0f} s | "
            f"{r['launch_to_first_step_s']} s | {r['launch_to_accuracy_0_8_s']} s | {r['steps_per_s']} |"
        )
    print(f"\nmachine: {machine}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
