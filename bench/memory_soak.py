"""Does a long run grow? The daemon, its engine and its other children, read by the run's own
memory watch (`grpod.daemon.memory`), per weight-bridge mode, and at what speed.

Per mode and variant: `grpod start --config CONFIG` (default etc/grpod.toml: the embedded
default, on the built tiny model) in a fresh run directory for `--steps` steps with `--set bridge.mode=MODE` (which
switches the file's mode), `metrics.memory_every_s = --every` and the variant's own `--set`s. From
the run's `memory` records: each figure at the first reading after the first `--warmup` steps and
at the last reading, and its least-squares slope over the readings after the warm-up, in MiB per
100 steps. From its `step` records after the warm-up: steps/s and generated tokens/s. `--repeat`
runs every (mode, variant) that many times, in turns (A B A B), so a drift of the machine falls on
each alike. The machine's load is recorded beside the figures.

    .venv/bin/python bench/memory_soak.py [--config etc/grpod.toml] [--modes none,shared] [--steps 600] [--every 5]
        [--warmup 50] [--variant LABEL:KEY=VALUE[;KEY=VALUE...]]... [--repeat 1]
        [--out bench/results/memory_soak.json]
    .venv/bin/python bench/memory_soak.py --table bench/results/memory_soak.json

e.g. oneDNN's primitive cache bounded on the engine (docs/performance.md):
    --variant 'default:' --variant 'cap0:inference.env={ONEDNN_PRIMITIVE_CACHE_CAPACITY="0"}'
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


def summarise(readings: list[dict], warmup: int, until: float | None = None) -> dict:
    """The readings from step `warmup` on, up to time `until` (the last step's: a reading taken
    while the run stops finds its engines half stopped)."""
    after = [r for r in readings if r["step"] >= warmup and (until is None or r["time"] <= until)]
    figures = {}
    for name, points in series(after).items():
        figures[name] = {
            "first_mib": points[0][1] if points else None,
            "last_mib": points[-1][1] if points else None,
            "slope_mib_per_100_steps": slope_per_100_steps(points),
        }
    return {"readings": len(readings), "readings_after_warmup": len(after),
            "steps": [after[0]["step"], after[-1]["step"]] if after else None, "figures": figures}


def speed(steps: list[dict], warmup: int) -> dict:
    """Steps/s and generated (completion) tokens/s between the first and the last step record at
    or after `warmup` (None under two such records)."""
    after = [r for r in steps if r["step"] >= warmup]
    if len(after) < 2 or after[-1]["time"] <= after[0]["time"]:
        return {"steps_per_s": None, "generated_tokens_per_s": None}
    seconds = after[-1]["time"] - after[0]["time"]
    tokens = sum(r.get("completion_tokens", 0.0) for r in after[1:])
    return {"steps_per_s": round((len(after) - 1) / seconds, 3), "generated_tokens_per_s": round(tokens / seconds, 1)}


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'LABEL:KEY=VALUE;KEY=VALUE' -> (LABEL, [--set values]); 'LABEL:' is the file as it is."""
    label, _, sets = text.partition(":")
    if not label:
        raise SystemExit(f"--variant {text!r}: expected LABEL:KEY=VALUE[;KEY=VALUE...]")
    return label, [item for item in sets.split(";") if item.strip()]


def one_run(mode: str, label: str, sets: list[str], args, work: Path, turn: int) -> dict:
    name = f"{mode}-{label}-{turn}"
    run_dir = work / f"run-{name}"
    began = time.monotonic()
    overrides = [f"run.dir={json.dumps(str(run_dir))}", f"bridge.mode={json.dumps(mode)}", f"train.steps={args.steps}",
                 f"metrics.memory_every_s={args.every}", *sets]
    with open(work / f"console-{name}.txt", "w") as console:
        code = subprocess.run(
            [sys.executable, "-m", "grpod", "start", "--config", str(args.config),
             *(arg for item in overrides for arg in ("--set", item))],
            cwd=ROOT, stdout=console, stderr=subprocess.STDOUT, timeout=7200,
        ).returncode
    if code != 0:
        tail = (work / f"console-{name}.txt").read_text()[-2000:]
        raise SystemExit(f"grpod start ({name}) exited {code}:\n{tail}")
    records = read_metrics(run_dir)
    readings = [r for r in records if r["kind"] == "memory"]
    steps = [r for r in records if r["kind"] == "step"]
    trained = sum(1 for r in steps if not r.get("skipped"))
    return {"mode": mode, "variant": label, "sets": sets, "turn": turn, "wall_s": round(time.monotonic() - began, 1),
            "trained_steps": trained, **speed(steps, args.warmup), **summarise(readings, args.warmup, last_step_time(steps)),
            "series": readings, "step_times": [[r["step"], r["time"]] for r in steps]}


def last_step_time(steps: list[dict]) -> float | None:
    return max((r["time"] for r in steps), default=None)


def print_table(result: dict) -> None:
    """The runs of a results file, each figure summarised again from its series (so a file
    written by an earlier version of this script reads the same way)."""
    print("| mode | variant | turn | trained steps | steps/s | generated tok/s | figure | MiB after warm-up → last | slope, MiB per 100 steps |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in result["runs"]:
        until = max((t for _, t in run.get("step_times", [])), default=None)
        if until is None:  # written before step times were kept: drop the reading after the last step
            until = max((r["time"] for r in run["series"] if r["step"] < result["steps"]), default=None)
        figures = summarise(run["series"], result["warmup_steps"], until)["figures"]
        for name, f in figures.items():
            print(f"| {run['mode']} | {run.get('variant', '')} | {run.get('turn', 0)} | {run['trained_steps']} | "
                  f"{run.get('steps_per_s')} | {run.get('generated_tokens_per_s')} | {name} | {f['first_mib']} → "
                  f"{f['last_mib']} | {f['slope_mib_per_100_steps']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "etc" / "grpod.toml")
    parser.add_argument("--modes", default="none,shared")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=float, default=5.0)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL:KEY=VALUE[;KEY=VALUE]")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "memory_soak.json")
    parser.add_argument("--table", type=Path, metavar="JSON", help="print the table of a results file and exit")
    args = parser.parse_args()
    if args.table:
        print_table(json.loads(args.table.read_text()))
        return
    variants = [parse_variant(v) for v in args.variant or ["default:"]]
    result = {"config": str(args.config.resolve().relative_to(ROOT)), "steps": args.steps, "every_s": args.every, "warmup_steps": args.warmup, "cpu_count": os.cpu_count(),
              "repeat": args.repeat, "load_before": os.getloadavg(), "runs": []}
    runs = result["runs"]
    with tempfile.TemporaryDirectory(prefix="grpod-soak-") as tmp:
        for turn in range(args.repeat):
            for mode in args.modes.split(","):
                for label, sets in variants:
                    runs.append(one_run(mode, label, sets, args, Path(tmp), turn))
                    result["load_after"] = os.getloadavg()
                    args.out.write_text(json.dumps(result, indent=1) + "\n")  # each run kept as it ends
    print_table(result)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
