"""How a CPU engine's generation rate depends on the sequences in flight (and its threads).

Launches the engine as grpod does (`InferenceProcess`, grpod's default engine settings for a
CPU: one engine thread per spare core) on SmolLM2-135M-Instruct and asks it for groups of
`--group-size` completions of exactly `--max-tokens` tokens (`ignore_eos`), `--groups` of them
in flight at a time, as the dataset source with `source.concurrency = --groups` would; reports
completion tokens per second over `--rounds` rounds (after one warm-up round). One engine per
thread count in `--threads`.

    .venv/bin/python bench/engine_batch.py [--groups 4 8 16] [--threads 1 2] [--out bench/results/engine_batch.json]

Needs `make model-smollm2`. Nothing else should run meanwhile (2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp
import anyio

from grpod.config import InferenceConfig, ModelConfig
from grpod.inference.process import InferenceProcess
from grpod.inference.sampling import with_neutral_sampling

ROOT = Path(__file__).resolve().parents[1]


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


async def measure(model: Path, threads: int, groups: list[int], args, work: Path) -> list[dict]:
    cfg = InferenceConfig(start_timeout_s=900, request_timeout_s=1800, kv_cache_bytes="1G",
                          env={"OMP_NUM_THREADS": str(threads)})
    process = InferenceProcess(cfg, ModelConfig(path=model, max_seq_len=512), work / f"threads-{threads}")
    pool = prompts(model, max(groups) * (args.rounds + 1))
    rows = []
    await process.start(model)
    try:
        for n in groups:
            await one_round(process.base_url, pool[:n], args.group_size, args.max_tokens)  # warm-up
            began, tokens = time.perf_counter(), 0
            for r in range(args.rounds):
                tokens += await one_round(process.base_url, pool[(r + 1) * n:(r + 2) * n], args.group_size, args.max_tokens)
            seconds = time.perf_counter() - began
            row = {"threads": threads, "groups_in_flight": n, "sequences_in_flight": n * args.group_size,
                   "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1)}
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
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "engine_batch.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="grpod-batch-") as tmp:
        for threads in args.threads:
            rows += anyio.run(measure, args.model, threads, args.groups, args, Path(tmp))
    print("| engine threads | sequences in flight | completion tokens/s |")
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['threads']} | {row['sequences_in_flight']} | {row['tokens_per_s']} |")
    args.out.write_text(json.dumps({"cpu_count": os.cpu_count(), "group_size": args.group_size,
                                    "max_tokens": args.max_tokens, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
