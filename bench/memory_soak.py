"""Does a long run grow? The daemon, its engine and its other children, read by the run's own
memory watch (`grpod.daemon.memory`), per weight-bridge mode.

Per mode: `grpod start --config etc/grpod.toml` (the embedded default, on the built tiny model) in a
fresh run directory for `--steps` steps with `bridge.mode = MODE` and `metrics.memory_every_s =
--every`. From the run's `memory` records: each figure at the first reading after the first
`--warmup` steps and at the last reading, and its least-squares slope over the readings after the
warm-up, in MiB per 100 steps. The machine's load is recorded beside the figures.

    .venv/bin/python bench/memory_soak.py [--modes none,shared] [--steps 600] [--every 5]
        [--warmup 50] [--out bench/results/memory_soak.json]
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

MIB = 1 << 20


def slope_per_100_steps(points: list[tuple[int, int]]) -> float | None:
    """Least-squares slope of bytes over steps, in MiB per 100 steps (None under 3 points)."""
    if len(points) < 3 or len({s for s, _ in points}) < 2:
        return None
    n = len(points)
    mean_s = sum(s for s, _ in points) / n
    mean_b = sum(b for _, b in points) / n
    cov = sum((s - mean_s) * (b - mean_b) for s, b in points)
    var = sum((s - mean_s) ** 2 for s, _ in points)
    return round(cov / var * 100 / MIB, 2)


def series(readings: list[dict]) -> dict[str, list[tuple[int, int]]]:
    """Each figure's (step, bytes) over the readings: daemon, children and every engine's RSS."""
    out: dict[str, list[tuple[int, int]]] = {"daemon": [], "children": []}
    for r in readings:
        out["daemon"].append((r["step"], r["daemon_rss"]))
        out["children"].append((r["step"], r["children_rss"]))
        for name, held in r["engines"].items():
            out.setdefault(name, []).append((r["step"], held["rss"]))
    return out


def summarise(readings: list[dict], warmup: int) -> dict:
    after = [r for r in readings if r["step"] >= warmup]
    figures = {}
    for name, points in series(after).items():
        figures[name] = {
            "first_mib": round(points[0][1] / MIB, 1) if points else None,
            "last_mib": round(points[-1][1] / MIB, 1) if points else None,
            "slope_mib_per_100_steps": slope_per_100_steps(points),
        }
    return {"readings": len(readings), "readings_after_warmup": len(after),
            "steps": [after[0]["step"], after[-1]["step"]] if after else None, "figures": figures}


def one_mode(mode: str, args, work: Path) -> dict:
    run_dir = work / f"run-{mode}"
    began = time.monotonic()
    subprocess.run([
        sys.executable, "-m", "grpod", "start", "--config", str(ROOT / "etc" / "grpod.toml"),
        "--set", f"run.dir={json.dumps(str(run_dir))}", "--set", f"bridge.mode={json.dumps(mode)}",
        "--set", f"train.steps={args.steps}", "--set", f"metrics.memory_every_s={args.every}",
    ], cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=7200)  # fmt: skip
    records = read_metrics(run_dir)
    readings = [r for r in records if r["kind"] == "memory"]
    trained = sum(1 for r in records if r["kind"] == "step" and not r.get("skipped"))
    return {"mode": mode, "wall_s": round(time.monotonic() - began, 1), "trained_steps": trained,
            **summarise(readings, args.warmup), "series": readings}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="none,shared")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=float, default=5.0)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "memory_soak.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="grpod-soak-") as tmp:
        runs = [one_mode(mode, args, Path(tmp)) for mode in args.modes.split(",")]
    result = {"steps": args.steps, "every_s": args.every, "warmup_steps": args.warmup, "cpu_count": os.cpu_count(),
              "load_before": load_before, "load_after": os.getloadavg(), "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"| mode | trained steps | wall s | figure | MiB after warm-up → last | slope, MiB per 100 steps |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        for name, f in run["figures"].items():
            print(f"| {run['mode']} | {run['trained_steps']} | {run['wall_s']} | {name} | "
                  f"{f['first_mib']} → {f['last_mib']} | {f['slope_mib_per_100_steps']} |")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
