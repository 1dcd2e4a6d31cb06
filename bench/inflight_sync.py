"""A weight sync with long generations in flight: in flight (the engine pauses between two
tokens, takes the weights, resumes: what grpod does) against waiting for the engine to be idle
(drain every running generation first, then sync: what a trainer that syncs between rollout
batches does).

Real vLLM (CPU build), mode `none` with the in-place reload, the daemon's own bridge and trainer.
Each trial trains one step on synthetic groups, starts `--generations` completions of exactly
`--tokens` tokens (min_tokens = max_tokens, token-in/token-out route, per-token weight versions),
waits until a quarter of their tokens are sampled, and syncs the step's weights:

- `in_flight`: the bridge's sync at once (pause keep → reload → new version → resume);
- `wait_for_idle`: wait for every generation to end, then the same sync.

Reported per trial: the sync's latency from the moment it was asked for to the engine serving the
new version (`sync_latency_s`: the drain included), the bridge's own sync time, how long the
generations took end to end, and the share of their tokens the new version sampled.

    .venv/bin/python bench/inflight_sync.py [--model models/smollm2-135m] [--generations 64] [--tokens 128] [--trials 3]

Writes bench/results/inflight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.sync_latency import synthetic_groups, trainer_and_bridge  # noqa: E402
from grpod.inference.client import metric_totals  # noqa: E402
from grpod.daemon.step_loop import train_batch  # noqa: E402

PROMPT_TOKENS = 24


async def generated_tokens(client) -> float:
    text = await client._request("GET", "/metrics")
    return metric_totals(text, ["vllm:generation_tokens_total"])["vllm:generation_tokens_total"]


async def trial(bridge, trainer, variant: str, generations: int, tokens: int, step: int, rng) -> dict:
    engine = bridge.engines[0]
    client = engine.client
    version = engine.version
    prompt = [rng.randrange(3, trainer.vocab_size) for _ in range(PROMPT_TOKENS)]
    completions: list = []
    ended = anyio.Event()

    async def generate(i: int) -> None:
        # Unseeded, as grpod's sources sample: a seeded request that the pause preempts crashes vLLM
        # 0.32's CPU engine when it is recomputed in chunks ("CPU Generator does not use offset").
        (completion,) = await client.generate(
            prompt, n=1, max_tokens=tokens, min_tokens=tokens, temperature=1.0,
            per_token_versions=True,
        )
        completions.append(completion)
        if len(completions) == generations:
            ended.set()

    record: dict = {"variant": variant}
    # The step first: its weights are what the sync ships, asked for once the generations run.
    await train_batch(trainer, bridge, synthetic_groups(rng, trainer.vocab_size, 2))
    with anyio.fail_after(1800):
        async with anyio.create_task_group() as tg:
            began = time.perf_counter()
            before = await generated_tokens(client)
            for i in range(generations):
                tg.start_soon(generate, i)
            while await generated_tokens(client) < before + generations * tokens / 4:
                await anyio.sleep(0.05)
            asked = time.perf_counter()
            if variant == "wait_for_idle":
                await ended.wait()
                record["drain_s"] = time.perf_counter() - asked
            sync = await bridge.after_step(step)
            assert sync is not None and sync.probe.get("ok", True), sync  # a probe only on its cadence
            record["sync_latency_s"] = time.perf_counter() - asked
            record["bridge_sync_s"] = sync.total_s
            await ended.wait()
            record["generations_s"] = time.perf_counter() - began
    new = engine.version
    assert new > version
    sampled = [v for c in completions for v in (c.versions or [])]
    record["tokens"] = sum(len(c.token_ids) for c in completions)
    record["new_version_share"] = sum(v == new for v in sampled) / max(len(sampled), 1)
    record["labelled_share"] = len(sampled) / max(record["tokens"], 1)
    return record


async def measure(model: Path, generations: int, tokens: int, trials: int, workdir: Path) -> list[dict]:
    import random

    trainer, bridge = trainer_and_bridge(workdir, model, [
        "train.lr=1e-6", 'bridge.mode="none"', 'bridge.reload="in_place"', "bridge.sync_every=1",
        "bridge.probe_every=1000", f"model.max_seq_len={PROMPT_TOKENS + tokens + 8}", 'inference.kv_cache_bytes="1G"',
    ])
    rng = random.Random(0)
    records = []
    try:
        await bridge.start()
        step = 0
        for t in range(trials):
            for variant in ("in_flight", "wait_for_idle"):
                step += 1
                records.append(await trial(bridge, trainer, variant, generations, tokens, step, rng))
                print(json.dumps(records[-1]), file=sys.stderr, flush=True)
    finally:
        await bridge.stop()
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    parser.add_argument("--generations", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="run directory to keep (vLLM's log); default a temporary one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="grpod-inflight-") as tmp:
        records = anyio.run(measure, args.model, args.generations, args.tokens, args.trials, args.keep or Path(tmp))
    print(f"{args.generations} generations of {args.tokens} tokens in flight, {args.model.name}, sync after a quarter\n")
    print("| sync | trials | asked → new version served (s) | drain (s) | bridge sync (s) | generations end to end (s) | tokens by the new version |")
    print("|---|---|---|---|---|---|---|")
    for variant in ("in_flight", "wait_for_idle"):
        rows = [r for r in records if r["variant"] == variant]

        def med(key: str) -> str:
            values = [r[key] for r in rows if key in r]
            return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})" if values else "—"

        share = statistics.median(r["new_version_share"] for r in rows)
        print(f"| {variant} | {len(rows)} | {med('sync_latency_s')} | {med('drain_s')} | {med('bridge_sync_s')} | "
              f"{med('generations_s')} | {share:.0%} |")
    out = ROOT / "bench" / "results" / "inflight_sync.json"
    out.write_text(json.dumps({"generations": args.generations, "tokens": args.tokens, "model": args.model.name,
                               "records": records}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
