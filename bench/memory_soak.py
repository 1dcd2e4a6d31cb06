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

def slope_per_100_steps(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope of MiB over steps, per 100 steps (None under 3 points)."""
    if len(points) < 3 or len({s for s, _ in points}) < 2:
        return None
    n = len(points)
    mean_s = sum(s for s, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    cov = sum((s - mean_s) * (m - mean_m) for s, m in points)
    var = sum((s - mean_s) ** 2 for s, _ in points)
    return round(cov / var * 100, 2)


def series(readings: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Each figure's (step, MiB) over the readings: the daemon's, its other children's and each
    engine's resident memory."""
    names = {"daemon_rss_mib": "daemon", "children_rss_mib": "children"}
    out: dict[str, list[tuple[int, float]]] = {}
    for r in readings:
        for key, value in r.items():
            kind, _, engine = key.partition("/")
            name = names.get(key) or {"engine_rss_mib": engine, "engine_gpu_mib": f"{engine} GPU"}.get(kind)
            if name:
                out.setdefault(name, []).append((r["step"], value))
    return out


def summarise(readings: list[dict], warmup: int) -> dict:
    after = [r for r in readings if r["step"] >= warmup]
    figures = {}
    for name, points in series(after).items():
        figures[name] = {
            "first_mib": points[0][1] if points else None,
            "last_mib": points[-1][1] if points else None,
            "slope_mib_per_100_steps": slope_per_100_steps(points),
        }
    return {"readings": len(readings), "readings_after_warmup": len(after),
            "steps": [after[0]["step"], after[-1]["step"]] if after else None, "figures": figures}


def mode_config(mode: str, work: Path) -> Path:
    """etc/grpod.toml for `mode`: its `bridge.reload` belongs to the `none` mode alone."""
    text = (ROOT / "etc" / "grpod.toml").read_text()
    if mode != "none":
        line = '\nreload = "in_place"\n'
        assert text.count(line) == 1, "etc/grpod.toml's bridge.reload moved"
        text = text.replace(line, "\n")
    path = work / f"grpod-{mode}.toml"
    path.write_text(text)
    return path


def one_mode(mode: str, args, work: Path) -> dict:
    run_dir = work / f"run-{mode}"
    began = time.monotonic()
    with open(work / f"console-{mode}.txt", "w") as console:
        code = subprocess.run([
            sys.executable, "-m", "grpod", "start", "--config", str(mode_config(mode, work)),
            "--set", f"run.dir={json.dumps(str(run_dir))}", "--set", f"bridge.mode={json.dumps(mode)}",
            "--set", f"train.steps={args.steps}", "--set", f"metrics.memory_every_s={args.every}",
        ], cwd=ROOT, stdout=console, stderr=subprocess.STDOUT, timeout=7200).returncode  # fmt: skip
    if code != 0:
        tail = (work / f"console-{mode}.txt").read_text()[-2000:]
        raise SystemExit(f"grpod start ({mode}) exited {code}:\n{tail}")
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
    result = {"steps": args.steps, "every_s": args.every, "warmup_steps": args.warmup, "cpu_count": os.cpu_count(),
              "load_before": load_before, "runs": []}
    runs = result["runs"]
    with tempfile.TemporaryDirectory(prefix="grpod-soak-") as tmp:
        for mode in args.modes.split(","):
            runs.append(one_mode(mode, args, Path(tmp)))
            result["load_after"] = os.getloadavg()
            args.out.write_text(json.dumps(result, indent=1) + "\n")  # each mode kept as it ends
    print(f"| mode | trained steps | wall s | figure | MiB after warm-up → last | slope, MiB per 100 steps |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        for name, f in run["figures"].items():
            print(f"| {run['mode']} | {run['trained_steps']} | {run['wall_s']} | {name} | "
                  f"{f['first_mib']} → {f['last_mib']} | {f['slope_mib_per_100_steps']} |")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
