"""Where a training step of the embedded default spends its CPU, process by process and thread by thread.

Runs `grpod start --config etc/grpod.toml` once per variant (interleaved `--repeat` times), waits
for step `--warm`, and measures the next `--window` steps: the CPU-seconds per step of every
process of the tree (the daemon, vLLM's API server, its EngineCore and, where vLLM runs one, its
Worker) and of the daemon's threads (the main thread runs the event loop: HTTP to vLLM, JSON,
validation, scoring, the control socket, metrics; the others are anyio's worker threads, where the
trainer's forward, backward and optimizer step and the weight saves run). Held-out evaluations
and checkpoints fall in the window as the config schedules them, as they do for a user.

`--functions` adds one more run of the last variant with the daemon under yappi (CPU clock, all
threads, started and stopped at the window's bounds) and prints the daemon's functions by own CPU
time. yappi slows Python code down, so that run's totals are not comparable with the others;
its shares say where the daemon's own time goes.

    .venv/bin/python bench/profile_step.py [--warm 10] [--window 60] [--repeat 2] [--functions]
        [--variant 'mp:inference.cpu_executor="mp"' --variant 'uni:'] [--set KEY=VALUE]

Prints Markdown tables and writes bench/results/profile_step.json (or `--out`). yappi comes with
the `bench` extra.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "peers"))
from compare import _label  # noqa: E402  (the process roles the peer bench reports)

DEFAULT_VARIANTS = ['mp, a Worker process (vLLM\'s CPU default):inference.cpu_executor="mp"', "uni (grpod's default):"]

# The daemon under yappi: the watcher thread starts the profiler at step `warm` and stops it at
# step `warm + window`, then writes the function and thread tables.
YAPPI_WRAPPER = r"""
import json, sys, threading, time
from pathlib import Path
import yappi
sys.path.insert(0, "bench")
from profile_step import StepWatch
run_dir, warm, window, out = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
sys.argv = ["grpod", *sys.argv[5:]]

def watch():
    step = StepWatch(run_dir)
    while step() < warm:
        time.sleep(0.05)
    yappi.set_clock_type("cpu")
    yappi.start(builtins=True, profile_threads=True)
    while step() < warm + window:
        time.sleep(0.05)
    yappi.stop()
    functions = [
        {"name": f.name, "module": f.module, "line": f.lineno, "calls": f.ncall, "own_s": f.tsub, "total_s": f.ttot}
        for f in yappi.get_func_stats()
    ]
    threads = [{"name": t.name, "id": t.id, "cpu_s": t.ttot} for t in yappi.get_thread_stats()]
    out.write_text(json.dumps({"functions": functions, "threads": threads}))

threading.Thread(target=watch, daemon=True).start()
from grpod.cli import main
sys.exit(main())
"""


class StepWatch:
    """The last step in a run's metrics.jsonl, read incrementally."""

    def __init__(self, run_dir: Path) -> None:
        self.path, self.offset, self.step = run_dir / "metrics.jsonl", 0, 0

    def __call__(self) -> int:
        try:
            with self.path.open() as f:
                f.seek(self.offset)
                for line in f:
                    if not line.endswith("\n"):
                        break
                    self.offset += len(line.encode())
                    if '"kind": "step"' in line:
                        self.step = max(self.step, json.loads(line)["step"])
        except OSError:
            pass
        return self.step


def snapshot(pid: int) -> dict:
    """CPU-seconds (user + system) of every process in the tree and of the root's threads."""
    root = psutil.Process(pid)
    procs: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            label = "daemon" if proc.pid == pid else (_label(proc) or "exited")
            t = proc.cpu_times()
            procs[label] = procs.get(label, 0.0) + t.user + t.system
        except psutil.Error:
            continue
    threads = {"event loop (main thread)": 0.0, "worker threads (trainer, saves)": 0.0}
    for t in root.threads():
        key = "event loop (main thread)" if t.id == pid else "worker threads (trainer, saves)"
        threads[key] += t.user_time + t.system_time
    return {"time": time.monotonic(), "procs": procs, "threads": threads}


def run_variant(label: str, sets: list[str], args, workdir: Path, index: int, yappi_out: Path | None = None) -> dict:
    run_dir = workdir / f"run-{index}"
    settings = [
        f"run.dir={json.dumps(str(run_dir))}", "run.resume=\"never\"", "run.progress=false",
        f"train.steps={args.warm + args.window + 2}", *args.set, *sets,
    ]  # fmt: skip
    grpod_argv = ["start", "--config", str(ROOT / "etc" / "grpod.toml"), *(f"--set={s}" for s in settings)]
    if yappi_out is None:
        argv = [sys.executable, "-m", "grpod", *grpod_argv]
    else:
        argv = [sys.executable, "-c", YAPPI_WRAPPER, str(run_dir), str(args.warm), str(args.window), str(yappi_out), *grpod_argv]
    log = (workdir / f"run-{index}.out").open("w")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    steps, start = StepWatch(run_dir), None
    deadline = time.monotonic() + args.run_timeout
    try:
        while steps() < args.warm:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{label}: the run ended or timed out before step {args.warm}; see {log.name}")
            time.sleep(0.02)
        start, first = snapshot(proc.pid), steps()
        while steps() < first + args.window:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{label}: the run ended or timed out in the window; see {log.name}")
            time.sleep(0.02)
        end, last = snapshot(proc.pid), steps()
        proc.wait(timeout=args.run_timeout)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the daemon stops its vLLM group on SIGTERM
            proc.wait(timeout=120)
        log.close()
    n = last - first
    per_step = {k: (end["procs"][k] - start["procs"].get(k, 0.0)) / n for k in end["procs"]}
    threads = {k: (end["threads"][k] - start["threads"][k]) / n for k in end["threads"]}
    return {
        "label": label, "sets": sets, "steps": n, "wall_s_per_step": (end["time"] - start["time"]) / n,
        "cpu_s_per_step": per_step, "cpu_s_per_step_total": sum(per_step.values()), "daemon_threads": threads,
    }  # fmt: skip


def median_table(results: list[dict], labels: list[str]) -> str:
    def med(values: list[float]) -> str:
        return f"{statistics.median(values):.3f}" + (f" [{min(values):.3f}-{max(values):.3f}]" if len(values) > 1 else "")

    rows: dict[str, dict[str, list[float]]] = {}
    for r in results:
        for key, value in [("wall s per step", r["wall_s_per_step"]), ("CPU-s per step, whole tree", r["cpu_s_per_step_total"]),
                           *((f"  {k}", v) for k, v in sorted(r["cpu_s_per_step"].items())),
                           *((f"  daemon: {k}", v) for k, v in r["daemon_threads"].items())]:  # fmt: skip
            rows.setdefault(key, {}).setdefault(r["label"], []).append(value)
    lines = ["| CPU-s per step | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for key, by_label in rows.items():
        lines.append(f"| {key} | " + " | ".join(med(by_label[lab]) if lab in by_label else "-" for lab in labels) + " |")
    return "\n".join(lines)


def function_table(profile: dict, top: int) -> str:
    funcs = sorted(profile["functions"], key=lambda f: f["own_s"], reverse=True)
    total = sum(f["own_s"] for f in funcs) or 1.0
    lines = ["| own CPU share | own s | calls | function |", "|---|---|---|---|"]
    for f in funcs[:top]:
        where = f["module"].replace(str(ROOT) + "/", "").split("site-packages/")[-1]
        lines.append(f"| {100 * f['own_s'] / total:.1f} % | {f['own_s']:.2f} | {f['calls']} | `{f['name']}` ({where}:{f['line']}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warm", type=int, default=10)
    parser.add_argument("--window", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--variant", action="append", help="LABEL:KEY=VALUE;KEY=VALUE (the label has no ':')")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    parser.add_argument("--functions", action="store_true", help="one more run under yappi: the daemon's functions")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--run-timeout", type=float, default=900.0)
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "profile_step.json")
    args = parser.parse_args()
    variants = []
    for spec in args.variant or DEFAULT_VARIANTS:
        label, _, sets = spec.partition(":")
        variants.append((label, [s for s in sets.split(";") if s]))
    labels = [label for label, _ in variants]
    results, profile = [], None
    with tempfile.TemporaryDirectory(prefix="grpod-profile-") as tmp:
        workdir, index = Path(tmp), 0
        for _ in range(args.repeat):
            for label, sets in variants:
                print(f"run {index}: {label}", file=sys.stderr, flush=True)
                results.append(run_variant(label, sets, args, workdir, index))
                index += 1
        if args.functions:
            label, sets = variants[-1]
            print(f"run {index}: {label} under yappi", file=sys.stderr, flush=True)
            yappi_out = workdir / "yappi.json"
            run_variant(label + " (yappi)", sets, args, workdir, index, yappi_out)
            profile = json.loads(yappi_out.read_text())
    table = median_table(results, labels)
    print(f"\nSteps {args.warm + 1}-{args.warm + args.window} of the embedded default, median [min-max] of {args.repeat} runs:\n")
    print(table)
    functions = None
    if profile:
        functions = function_table(profile, args.top)
        print(f"\nThe daemon under yappi ({variants[-1][0]}), own CPU time by function, all threads:\n")
        print(functions)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "title": "CPU per training step of the embedded default, by process and daemon thread",
        "label": args.label, "warm": args.warm, "window": args.window, "repeat": args.repeat, "set": args.set,
        "machine": {"cpus": psutil.cpu_count(), "platform": platform.platform(), "load_avg_at_end": psutil.getloadavg()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs": results, "table": table,
        "functions_table": functions, "yappi": profile and {"threads": profile["threads"],
            "functions": sorted(profile["functions"], key=lambda f: f["own_s"], reverse=True)[:200]},
    }, indent=1) + "\n")  # fmt: skip
    print(f"\nwritten {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
