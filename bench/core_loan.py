"""What lending the trainer's core to a CPU engine buys, per model (`grpod.inference.cores`).

Launches each model's engine as grpod does (one engine, worker inside EngineCore, its own threads =
cores - 1, grpod's worker extension), then alternates rounds of generation at the engine's own
thread count and at own + 1 (the trainer's one thread), switched at run time with
`grpod_set_threads` exactly as `CoreLoan` does. Each round: `--groups` groups of `--group-size`
completions of `--max-tokens` tokens in flight (SmolLM2: 128 tokens, `ignore_eos`; the tiny model:
8, its task's budget). Also times the switch itself while a round generates (the call waits for the
engine step in progress). Nothing else should run meanwhile.

    .venv/bin/python bench/core_loan.py [--models tiny smollm2] [--rounds 2] [--out bench/results/core_loan.json]

Needs `make model` and `make model-smollm2`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from engine_batch import one_round, prompts  # noqa: E402

from grpod.config import InferenceConfig, ModelConfig  # noqa: E402
from grpod.inference.cores import engine_threads, weight_bytes  # noqa: E402
from grpod.inference.process import InferenceProcess  # noqa: E402

MODELS = {
    "tiny": {"path": ROOT / "models" / "tiny-arith", "max_tokens": 8, "groups": 8, "group_size": 8},
    "smollm2": {"path": ROOT / "models" / "smollm2-135m", "max_tokens": 128, "groups": 8, "group_size": 4},
}


def tiny_prompts(count: int) -> list[list[int]]:
    import random

    from transformers import AutoTokenizer

    from grpod.rollouts.arithmetic import ArithmeticTask

    tokenizer = AutoTokenizer.from_pretrained(MODELS["tiny"]["path"])
    task, rng = ArithmeticTask(seed=1234), random.Random(0)
    return [task.prompt_for(tokenizer, task.sample(rng)) for _ in range(count)]


async def measure(name: str, spec: dict, args, work: Path) -> dict:
    cfg = InferenceConfig(start_timeout_s=900, request_timeout_s=1800, kv_cache_bytes="1G")
    own = engine_threads(cfg)
    borrowed = own + 1
    process = InferenceProcess(cfg, ModelConfig(path=spec["path"], max_seq_len=256), work / name)
    groups, size, tokens = spec["groups"], spec["group_size"], spec["max_tokens"]
    rounds_needed = (2 * args.rounds + 2) * groups
    pool = tiny_prompts(rounds_needed) if name == "tiny" else prompts(spec["path"], rounds_needed)
    rates: dict[int, list[float]] = {own: [], borrowed: []}
    switch_ms: list[float] = []
    await process.start(spec["path"])
    try:
        async with process.client() as client:
            async def set_threads(n: int) -> None:
                (now,) = await client.collective_rpc("grpod_set_threads", args=[str(n)])
                assert int(now) == n, (now, n)

            at = 0

            async def one(n: int) -> float:
                nonlocal at
                await set_threads(n)
                batch, at = pool[at:at + groups], at + groups
                began = time.perf_counter()
                produced = await one_round(process.base_url, batch, size, tokens)
                return produced / (time.perf_counter() - began)

            await one(own)  # warm-up
            for _ in range(args.rounds):
                for n in (own, borrowed):
                    rates[n].append(await one(n))
            # The switch's cost while the engine generates: lend and reclaim in the middle of a round.
            async with anyio.create_task_group() as tg:
                tg.start_soon(one_round, process.base_url, pool[at:at + groups], size, tokens)
                for n in (borrowed, own) * 3:
                    await anyio.sleep(0.2)
                    began = time.perf_counter()
                    await set_threads(n)
                    switch_ms.append((time.perf_counter() - began) * 1000)
    finally:
        await process.stop()
    median = {n: statistics.median(r) for n, r in rates.items()}
    row = {
        "model": name, "weights_mib": round(weight_bytes(spec["path"]) / 2**20, 1), "own_threads": own,
        "borrowed_threads": borrowed, "sequences_in_flight": groups * size, "max_tokens": tokens,
        "tokens_per_s_own": round(median[own], 1), "tokens_per_s_borrowed": round(median[borrowed], 1),
        "gain": round(median[borrowed] / median[own], 3),
        "rounds": {str(n): [round(r, 1) for r in rs] for n, rs in rates.items()},
        "switch_ms_median": round(statistics.median(switch_ms), 1), "switch_ms_max": round(max(switch_ms), 1),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "smollm2"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "core_loan.json")
    args = parser.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 cores or more: the engine must have a core to borrow")
    rows = []
    with tempfile.TemporaryDirectory(prefix="grpod-loan-") as tmp:
        for name in args.models:
            rows.append(anyio.run(measure, name, MODELS[name], args, Path(tmp)))
    print("| model | weights | sequences in flight | tokens/s, own threads | tokens/s, + trainer's | gain | switch (ms, median / max) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['weights_mib']} MiB | {r['sequences_in_flight']} | {r['tokens_per_s_own']} "
              f"({r['own_threads']}) | {r['tokens_per_s_borrowed']} ({r['borrowed_threads']}) | {r['gain']}x | "
              f"{r['switch_ms_median']} / {r['switch_ms_max']} |")
    args.out.write_text(json.dumps({"cpu_count": os.cpu_count(), "load_before": os.getloadavg(), "rows": rows},
                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
