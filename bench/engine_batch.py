"""How a CPU engine's generation rate depends on the sequences in flight (and its threads).

Launches the engine as grpod does (`InferenceProcess`, grpod's default engine settings for a
CPU: one engine thread per spare core) on SmolLM2-135M-Instruct and asks it for groups of
`--group-size` completions of exactly `--max-tokens` tokens (`ignore_eos`), `--groups` of them
in flight at a time, as the dataset source with `source.concurrency = --groups` would; reports
completion tokens per second over `--rounds` rounds (after one warm-up round). One engine per
thread count in `--threads`, and per KV-cache block size in `--block-sizes` (inference.block_size;
vLLM's own on a CPU is 128 tokens). Each row has the engine's prefix-cache hit rate (its
/metrics counters over the measured rounds): a group's completions share their prompt, and vLLM
serves a shared prompt from its cache only in whole blocks, so a prompt shorter than one block is
computed once per completion.

    .venv/bin/python bench/engine_batch.py [--groups 4 8 16] [--threads 1 2] [--block-sizes 128 32] \
        [--group-size 4] [--max-tokens 128] [--out bench/results/engine_batch.json]

Needs `make model-smollm2`. Nothing else should run meanwhile (2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import anyio

from grpod.config import InferenceConfig, ModelConfig
from grpod.inference.process import InferenceProcess
from grpod.inference.sampling import with_neutral_sampling

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpod.inference.client import metric_totals  # noqa: E402


def prompts(model: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in (ROOT / "etc/examples/arith-word/train.jsonl").read_text().splitlines()][:count]
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
        for row in rows
    ]


async def one_round(url: str, batch: list[list[int]], group_size: int, max_tokens: int) -> int:
    tokens = 0

    async def group(session: aiohttp.ClientSession, prompt_ids: list[int]) -> None:
        nonlocal tokens
        body = with_neutral_sampling({"model": "policy", "prompt": prompt_ids, "n": group_size, "max_tokens": max_tokens,
                                      "min_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0, "logprobs": 0,
                                      "return_token_ids": True})
        async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(1800)) as r:
            answer = await r.json()
        tokens += sum(len(c["token_ids"]) for c in answer["choices"])

    async with aiohttp.ClientSession() as session, anyio.create_task_group() as tg:
        for prompt_ids in batch:
            tg.start_soon(group, session, prompt_ids)
    return tokens


async def prefix_cache_counters(url: str) -> tuple[float, float]:
    """(queries, hits) of the engine's prefix cache, in tokens, from its Prometheus counters."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        text = await r.text()
    totals = metric_totals(text, ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"])
    return totals["vllm:prefix_cache_queries_total"], totals["vllm:prefix_cache_hits_total"]


async def measure(model: Path, threads: int, block_size: int, groups: list[int], args, work: Path) -> list[dict]:
    cfg = InferenceConfig(start_timeout_s=900, request_timeout_s=1800, kv_cache_bytes="1G",
                          env={"OMP_NUM_THREADS": str(threads)}, block_size=block_size)
    process = InferenceProcess(cfg, ModelConfig(path=model, max_seq_len=512), work / f"threads-{threads}-{block_size}")
    pool = prompts(model, max(groups) * (args.rounds + 1))
    rows = []
    await process.start(model)
    try:
        for n in groups:
            await one_round(process.base_url, pool[:n], args.group_size, args.max_tokens)  # warm-up
            queries, hits = await prefix_cache_counters(process.base_url)
            began, tokens = time.perf_counter(), 0
            measured = pool[n:(args.rounds + 1) * n]
            for r in range(args.rounds):
                tokens += await one_round(process.base_url, pool[(r + 1) * n:(r + 2) * n], args.group_size, args.max_tokens)
            seconds = time.perf_counter() - began
            queries_after, hits_after = await prefix_cache_counters(process.base_url)
            row = {"threads": threads, "block_size": block_size, "groups_in_flight": n,
                   "sequences_in_flight": n * args.group_size,
                   "prompt_tokens_mean": round(sum(map(len, measured)) / len(measured), 1),
                   "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
                   "prefix_cache_hit_rate": round((hits_after - hits) / max(queries_after - queries, 1), 3)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        await process.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[128, 32],
                        help="inference.block_size per engine (128: vLLM's own on a CPU; a CPU takes multiples of 32)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "engine_batch.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="grpod-batch-") as tmp:
        for threads in args.threads:
            for block_size in args.block_sizes:
                rows += anyio.run(measure, args.model, threads, block_size, args.groups, args, Path(tmp))
    print("| engine threads | block size | sequences in flight | completion tokens/s | prefix-cache hit rate |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['threads']} | {row['block_size']} | {row['sequences_in_flight']} | {row['tokens_per_s']} "
              f"| {row['prefix_cache_hit_rate']} |")
    args.out.write_text(json.dumps({"cpu_count": os.cpu_count(), "group_size": args.group_size,
                                    "max_tokens": args.max_tokens, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
