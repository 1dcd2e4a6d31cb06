"""Sync time against the number of engines and the model's size: `none` in place vs `broadcast`.

For each model (the tiny built-in one, and a ~100M-parameter random Qwen2 of the same family) and
each engine count (1, 2), a bridge of each mode is started over real vLLM engines (CPU build), the
trainer takes a step on synthetic groups and the bridge syncs, `--syncs` times; the table gives
each configuration's median sync (trainer half + engines' half, probe included) and its main
phases. `none` reloads a saved HF checkpoint in every engine in turn; `broadcast` sends the
trainer's weights to all engines at once through vLLM's weight-transfer API (gloo on CPU).

    .venv/bin/python bench/scale.py [--syncs 5] [--models tiny,100m] [--engines 1,2]
        [--modes none,broadcast] [--out bench/results/scale.json]

FSDP trainer ranks: `--fsdp` adds the step time of one process vs 2 ranks under torchrun
(FSDP2 over gloo, one torch thread per rank), the tiny model and a 13.7M-parameter Qwen2, on
recorded groups (no vLLM): `tests/training/fsdp_ranks.py`, the trainer the daemon runs, timed per
step; the table gives the median over steps 2.. (step 1 pays the first-call costs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sync_latency import synthetic_groups  # noqa: E402
from grpod.config import load_config  # noqa: E402
from grpod.daemon.components import build_bridge, build_engines  # noqa: E402
from grpod.daemon.step_loop import train_batch  # noqa: E402
from grpod.models.tiny import build_model, save_model  # noqa: E402
from grpod.training.trainer import build_trainer  # noqa: E402

MODELS = {"tiny": {}, "100m": {"hidden_size": 1024, "layers": 8}, "14m": {"hidden_size": 512, "layers": 4}}
FSDP_STEPS = 8
MODES = {"none": ["bridge.mode=none", "bridge.reload=in_place"], "broadcast": ["bridge.mode=broadcast"]}


def make_model(name: str, root: Path) -> tuple[Path, int]:
    out = root / f"model-{name}"
    model, tokenizer = build_model(seed=0, **MODELS[name])
    save_model(model, tokenizer, out)
    return out, sum(p.numel() for p in model.parameters())


async def measure(mode: str, model: Path, engines: int, syncs: int, workdir: Path) -> list[dict]:
    run_dir = workdir / f"{mode}-{engines}-{model.name}"
    cfg = load_config(
        None,
        [
            f"run.dir={json.dumps(str(run_dir))}",
            f"model.path={json.dumps(str(model))}",
            "model.init_if_missing=false",
            "train.threads=1",
            "train.lr=1e-4",
            "bridge.sync_every=1",
            "inference.start_timeout_s=600",
            "inference.kv_cache_bytes='256M'",
            f"inference.engines={engines}",
            *MODES[mode],
        ],
    )
    trainer = build_trainer(cfg)
    bridge = build_bridge(cfg, run_dir, build_engines(cfg, run_dir), trainer=trainer)
    records = []
    import random

    rng = random.Random(0)
    try:
        await bridge.start()
        for _ in range(syncs):
            await train_batch(trainer, bridge, synthetic_groups(rng, trainer.vocab_size, 2))
            began = time.perf_counter()
            record = await bridge.sync_now()
            wall = time.perf_counter() - began
            assert record.probe["ok"], record.probe
            records.append({"total_s": record.total_s, "wall_s": wall, **{f"{k}_s": v for k, v in record.phases.items()}})
    finally:
        await bridge.stop()
    return records


def fsdp_step_times(model_name: str, ranks: int, root: Path) -> list[float]:
    """Per-step seconds of the trainer on `ranks` FSDP ranks (1: one process, no torchrun)."""
    from tests.faults.injection import write_replay_rollouts

    work = root / f"fsdp-{model_name}-{ranks}"
    work.mkdir(parents=True)
    model, _ = make_model(model_name, work)
    replay = work / "rollouts.jsonl"
    write_replay_rollouts(replay, model, groups=FSDP_STEPS * 8, completion_len=96)
    config = work / "grpod.toml"
    config.write_text("\n".join([
        "[run]", f"dir = {json.dumps(str(work / 'run'))}",
        "[model]", f"path = {json.dumps(str(model))}", "init_if_missing = false",
        "[source]", 'kind = "replay"', f"replay_path = {json.dumps(str(replay))}",
        "[train]", "groups_per_step = 8", "threads = 1", "max_staleness = 1000",
        "[bridge]", 'mode = "none"',
    ]) + "\n")  # fmt: skip
    script = ROOT / "tests" / "training" / "fsdp_ranks.py"
    launcher = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    subprocess.run(
        [*launcher, str(script), str(config), str(work / "out"), "--steps", str(FSDP_STEPS)], cwd=ROOT, check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, capture_output=True, timeout=3600,
    )  # fmt: skip
    steps = json.loads((work / "out" / "result.json").read_text())["steps"]
    return [steps[key]["seconds"] for key in sorted(steps, key=int)]


def median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--models", default="tiny,100m")
    parser.add_argument("--engines", default="1,2")
    parser.add_argument("--modes", default="none,broadcast")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    parser.add_argument("--fsdp", action="store_true", help="also the step time of 1 process vs 2 FSDP ranks")
    parser.add_argument("--fsdp-models", default="tiny,14m")
    args = parser.parse_args()
    rows = []
    fsdp_rows = []
    with tempfile.TemporaryDirectory(prefix="grpod-scale-") as tmp:
        for model_name in args.fsdp_models.split(",") if args.fsdp else []:
            for ranks in (1, 2):
                times = fsdp_step_times(model_name, ranks, Path(tmp))
                fsdp_rows.append({"model": model_name, "ranks": ranks, "step_median_s": statistics.median(times[1:]),
                                  "step_s": times})
                print(f"fsdp {model_name} x{ranks}: done", file=sys.stderr, flush=True)
        for model_name in [m for m in args.models.split(",") if m]:
            model, params = make_model(model_name, Path(tmp))
            for engines in (int(n) for n in args.engines.split(",")):
                for mode in args.modes.split(","):
                    began = time.monotonic()
                    records = anyio.run(measure, mode, model, engines, args.syncs, Path(tmp))
                    rows.append({
                        "model": model_name, "params": params, "engines": engines, "mode": mode,
                        "sync_median_s": median(records, "total_s"),
                        "phases_median_s": {k: median(records, k) for k in sorted({k for r in records for k in r})},
                        "records": records, "wall_s": round(time.monotonic() - began, 1),
                    })  # fmt: skip
                    print(f"{model_name} x{engines} {mode}: done", file=sys.stderr, flush=True)
    print("| model | params | engines | mode | sync median (ms) | save/copy (ms) | apply (ms) | probe (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["phases_median_s"]
        ms = lambda key: f"{p[key] * 1000:.0f}" if p.get(key) is not None else "-"  # noqa: E731
        print(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['engines']} | {r['mode']} | "
              f"{r['sync_median_s'] * 1000:.0f} | {ms('save_s')} | {ms('apply_s')} | {ms('probe_s')} |")
    if fsdp_rows:
        print("\n| model | trainer | step median (s) | steps timed |")
        print("|---|---|---|---|")
        for r in fsdp_rows:
            who = "1 process" if r["ranks"] == 1 else f"{r['ranks']} FSDP ranks (torchrun, gloo)"
            print(f"| {r['model']} | {who} | {r['step_median_s']:.3f} | {len(r['step_s']) - 1} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "fsdp": fsdp_rows, "machine": "2 CPU cores (see the label of the run)"},
                                   indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
