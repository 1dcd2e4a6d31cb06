"""A real pretrained model on your own task: SmolLM2-135M-Instruct on the shipped arith-word task.

Runs `grpod start --config etc/examples/smollm2-dataset.toml` (real vLLM, the dataset source, the
example's reward module, completions of up to 64 tokens) once per seed for a fixed wall-clock
budget, then `ctl stop` (the daemon finishes its step, evaluates, exits). Only the bookkeeping
and the seeds change: `run.seed = N`, `source.dataset.shuffle_seed = N`, a fresh run directory, no
checkpoints; `--set` pairs on the command line are passed through (e.g. `train.lr=3e-6`,
`train.lora=true bridge.mode="lora_only"`).

Per seed, from the run's own records (metrics.jsonl) and a 1 s sampler of memory:
- held-out greedy pass@1 and mean@k (the daemon's `eval.dataset` evaluation) at the start and
  at the end;
- wall time of the whole process (vLLM start-up included) and steps trained;
- generated tokens/s: completion tokens trained / seconds from the first step to the last
  (generation overlaps training, so this is the rate the pipeline delivered them);
- trainer tokens/s: tokens (prompt + completion) / seconds inside the optimizer step;
- mean |trainer - vLLM| logprob per completion token (`logprob_diff_abs_mean`, the sampling
  contract's health: 0.175 nats/token before `--generation-config vllm` and neutral sampling);
- peak RSS of the daemon (trainer) and of vLLM's process group (sum of RSS, shared pages counted
  in each process).

    .venv/bin/python bench/real_model.py [--seeds 0 1 2] [--minutes 20] [--out bench/results/real_model.json]
        [--set key=value ...]

Needs `make model-smollm2`. Each finished seed is appended to the JSON at once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from grpod.service.logs import read_metrics

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "etc" / "examples" / "smollm2-dataset.toml"
MODEL = ROOT / "models" / "smollm2-135m"


class MemorySampler(threading.Thread):
    """Peak RSS of the daemon and of every process group it launched (vLLM), sampled each second."""

    def __init__(self, pid: int, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.pid, self.run_dir = pid, run_dir
        self.peak_daemon = self.peak_vllm = 0
        self.done = threading.Event()

    def _vllm_pgids(self) -> set[int]:
        log = self.run_dir / "grpod.log"
        found = set()
        if log.exists():
            for line in log.read_text(errors="replace").splitlines():
                if '"inference_launched"' in line:
                    try:
                        found.add(int(json.loads(line)["pid"]))
                    except (ValueError, KeyError):
                        pass
        return found

    def run(self) -> None:
        while not self.done.wait(1.0):
            try:
                self.peak_daemon = max(self.peak_daemon, psutil.Process(self.pid).memory_info().rss)
            except psutil.Error:
                pass
            pgids = self._vllm_pgids()
            total = 0
            for proc in psutil.process_iter(["pid"]):
                try:
                    if os.getpgid(proc.pid) in pgids:
                        total += proc.memory_info().rss
                except (psutil.Error, ProcessLookupError):
                    continue
            self.peak_vllm = max(self.peak_vllm, total)


def run_once(seed: int, minutes: float, workdir: Path, extra: list[str]) -> dict:
    run_dir = workdir / f"seed{seed}"
    settings = {
        "run.dir": str(run_dir),
        "run.resume": "never",
        "run.progress": False,
        "run.seed": seed,
        "source.dataset.shuffle_seed": seed,
        "model.path": str(MODEL),
        "train.steps": 100000,
        "checkpoint.every": 0,
        "checkpoint.at_shutdown": False,
        "eval.every": 0,
    }
    overrides = [f"--set={key}={json.dumps(value)}" for key, value in settings.items()]
    overrides += [f"--set={item}" for item in extra]
    began = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpod", "start", "--config", str(CONFIG), *overrides],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    sampler = MemorySampler(proc.pid, run_dir)
    sampler.start()
    try:
        # The budget counts from the first trained step (vLLM start-up and the first evaluation
        # are reported apart, in wall_s).
        first_step = None
        while proc.poll() is None:
            steps = _records(run_dir, "step")
            if steps and first_step is None:
                first_step = time.monotonic()
            if first_step is not None and time.monotonic() - first_step >= minutes * 60:
                break
            time.sleep(2.0)
        if proc.poll() is None:
            subprocess.run(
                [sys.executable, "-m", "grpod", "ctl", "stop", "--socket", str(run_dir / "grpod.sock")],
                cwd=ROOT, check=False, timeout=120, stdout=subprocess.DEVNULL,
            )  # fmt: skip
        code = proc.wait(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        sampler.done.set()
        sampler.join(timeout=5)
    wall = time.monotonic() - began
    steps = [r for r in _records(run_dir, "step") if not r.get("skipped")]
    evals = _records(run_dir, "eval")
    t0 = min(r["time"] for r in steps) if steps and "time" in steps[0] else None
    t1 = max(r["time"] for r in steps) if steps and "time" in steps[0] else None
    span = (t1 - t0) if t0 is not None and t1 is not None and t1 > t0 else None
    completion_tokens = sum(r.get("loss_tokens", 0.0) for r in steps)
    gaps = [r["logprob_diff_abs_mean"] for r in steps if r.get("logprob_diff_abs_mean") is not None]
    return {
        "seed": seed,
        "exit_code": code,
        "overrides": extra,
        "wall_s": round(wall, 1),
        "train_minutes": minutes,
        "steps": len(steps),
        "pass1_start": evals[0].get("eval_accuracy") if evals else None,
        "pass1_end": evals[-1].get("eval_accuracy") if len(evals) > 1 else None,
        "mean_at_k_start": evals[0].get("eval_mean_at_k") if evals else None,
        "mean_at_k_end": evals[-1].get("eval_mean_at_k") if len(evals) > 1 else None,
        "eval_size": evals[-1].get("eval_size") if evals else None,
        "reward_first10": _mean([r.get("reward_mean") for r in steps[:10]]),
        "reward_last10": _mean([r.get("reward_mean") for r in steps[-10:]]),
        "generated_tokens_per_s": round(completion_tokens / span, 2) if span else None,
        "trainer_tokens_per_s": round(sum(r.get("tokens", 0.0) for r in steps) / max(sum(r.get("train_s", 0.0) for r in steps), 1e-9), 1),
        "logprob_gap_abs_mean": round(statistics.fmean(gaps), 5) if gaps else None,
        "peak_rss_daemon_mb": round(sampler.peak_daemon / 2**20),
        "peak_rss_vllm_mb": round(sampler.peak_vllm / 2**20),
        "reward_curve": [round(r.get("reward_mean", 0.0), 3) for r in steps],
    }


def _records(run_dir: Path, kind: str) -> list[dict]:
    if not (run_dir / "metrics.jsonl").exists():
        return []
    return [r for r in read_metrics(run_dir) if r.get("kind") == kind]


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.fmean(values), 3) if values else None


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def table(rows: list[dict]) -> str:
    head = (
        "| seed | steps | wall s | pass@1 start → end | mean@k start → end | reward first10 → last10 | "
        "gen tok/s | trainer tok/s | |gap| nats/tok | peak RSS trainer / vLLM MB |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['steps']} | {r['wall_s']:.0f} | {_fmt(r['pass1_start'])} → {_fmt(r['pass1_end'])} | "
            f"{_fmt(r['mean_at_k_start'])} → {_fmt(r['mean_at_k_end'])} | {_fmt(r['reward_first10'])} → "
            f"{_fmt(r['reward_last10'])} | {_fmt(r['generated_tokens_per_s'])} | {_fmt(r['trainer_tokens_per_s'])} | "
            f"{_fmt(r['logprob_gap_abs_mean'])} | {r['peak_rss_daemon_mb']} / {r['peak_rss_vllm_mb']} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--minutes", type=float, default=20.0, help="training time per seed, from the first step")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "real_model.json")
    parser.add_argument("--set", dest="extra", action="append", default=[], help="key=value passed to grpod start")
    args = parser.parse_args()
    if not (MODEL / "config.json").exists():
        print(f"{MODEL} is missing: run `make model-smollm2`", file=sys.stderr)
        return 2
    rows = json.loads(args.out.read_text()) if args.out.exists() else []
    with tempfile.TemporaryDirectory(prefix="grpod-bench-real-") as tmp:
        for seed in args.seeds:
            row = run_once(seed, args.minutes, Path(tmp), args.extra)
            rows.append(row)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(rows, indent=2) + "\n")
            print(table([row]).splitlines()[-1], flush=True)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
