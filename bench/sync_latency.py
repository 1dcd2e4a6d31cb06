"""Weight-sync latency per bridge mode on the tiny model (real vLLM, CPU build).

For each mode: build the trainer and the bridge exactly as the daemon does, start vLLM, then
repeat {one training step on synthetic groups → the bridge's scheduled sync} N times and record
the sync's phases (save, transfer/reload, stop, launch, probe...). One run, one table: median and
spread (min–max) of the total and of each phase.

    .venv/bin/python bench/sync_latency.py [--syncs 10] [--modes none_in_place,none_restart,lora_only,lora_restart,shared]

Writes bench/results/sync_latency.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpod.config import load_config  # noqa: E402
from grpod.daemon.components import build_bridge, build_engines  # noqa: E402
from grpod.daemon.step_loop import train_batch  # noqa: E402
from grpod.rollouts.group import RolloutGroup  # noqa: E402
from grpod.training.trainer import build_trainer  # noqa: E402

MODES = {
    "none_in_place": ["bridge.mode=none", "bridge.reload=in_place"],
    "none_restart": ["bridge.mode=none", "bridge.reload=restart"],
    "lora_only": ["bridge.mode=lora_only", "train.lora=true"],
    "lora_restart": ["bridge.mode=lora_restart", "train.lora=true"],
    "shared": ["bridge.mode=shared"],
}


def synthetic_groups(rng: random.Random, vocab: int, count: int) -> list[RolloutGroup]:
    groups = []
    for g in range(count):
        prompt = [rng.randrange(3, vocab) for _ in range(12)]
        tokens, masks, logprobs = [], [], []
        for _ in range(4):
            completion = [rng.randrange(3, vocab) for _ in range(6)]
            tokens.append(prompt + completion)
            masks.append([0] * len(prompt) + [1] * len(completion))
            logprobs.append([0.0] * len(prompt) + [-rng.uniform(2.0, 5.0) for _ in completion])
        groups.append(RolloutGroup(tokens, masks, [0.0, 1.0, 0.5, 0.2], logprobs, group_id=f"bench-{g}"))
    return groups


def trainer_and_bridge(run_dir: Path, model: Path, overrides: list[str]):
    """The trainer and the bridge over one engine, built as the daemon builds them (one trainer thread)."""
    cfg = load_config(
        None, [f"run.dir={json.dumps(str(run_dir))}", f"model.path={json.dumps(str(model))}", "train.threads=1", *overrides]
    )
    trainer = build_trainer(cfg)
    return trainer, build_bridge(cfg, cfg.run.dir, build_engines(cfg, cfg.run.dir), trainer=trainer)


async def measure(mode: str, model: Path, syncs: int, workdir: Path) -> list[dict]:
    trainer, bridge = trainer_and_bridge(
        workdir / mode, model, ["train.lr=1e-3", "bridge.sync_every=1", *MODES[mode]]
    )
    rng = random.Random(0)
    records = []
    try:
        await bridge.start()
        for step in range(1, syncs + 1):
            began = time.perf_counter()
            # `shared`: the update is fenced, its sync made inside train_batch; others sync after.
            _, fenced = await train_batch(trainer, bridge, synthetic_groups(rng, trainer.vocab_size, 2))
            if not fenced:
                began = time.perf_counter()
            record = fenced[0] if fenced else await bridge.after_step(step)
            wall = time.perf_counter() - began
            assert record is not None and record.probe["ok"], record
            records.append({"total_s": record.total_s, "wall_s": wall, **{f"{k}_s": v for k, v in record.phases.items()}})
    finally:
        await bridge.stop()
    return records


def summarise(records: list[dict]) -> dict:
    keys = sorted({k for r in records for k in r})
    out = {}
    for key in keys:
        values = [r[key] for r in records if key in r]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--syncs", type=int, default=10)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "tiny-arith")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="grpod-sync-") as tmp:
        for mode in args.modes.split(","):
            records = anyio.run(measure, mode, args.model, args.syncs, Path(tmp))
            results[mode] = {"summary": summarise(records), "records": records}
            print(f"{mode}: done ({len(records)} syncs)", file=sys.stderr)
    print("| mode | syncs | total median (ms) | total min–max (ms) | phases: median ms |")
    print("|---|---|---|---|---|")
    for mode, result in results.items():
        s = result["summary"]
        phases = ", ".join(
            f"{k[:-2]} {v['median'] * 1000:.1f}" for k, v in s.items() if k not in ("total_s", "wall_s")
        )
        t = s["total_s"]
        print(
            f"| {mode} | {t['n']} | {t['median'] * 1000:.1f} | {t['min'] * 1000:.1f}–{t['max'] * 1000:.1f} | {phases} |"
        )
    if "none_in_place" in results and "none_restart" in results:
        ratio = results["none_restart"]["summary"]["total_s"]["median"] / results["none_in_place"]["summary"]["total_s"]["median"]
        print(f"\nnone: in-place reload is {ratio:.0f}x faster than restart (target >= 10x)")
    out = ROOT / "bench" / "results" / "sync_latency.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
