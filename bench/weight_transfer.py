"""gloo weight-transfer sync time to 1 and to 2 real vLLM engines (CPU build), phase by phase.

Launches two engines on the tiny model (gloo backend, grpod's worker extension), then for each
configuration (engines x chunk size): forms a group `--groups` times and syncs perturbed weights
`--syncs` times per group. Phases, seen from the trainer: group formation (engines' init and rank
0's join, concurrently), start (`/start_weight_update`), update (`/update_weights` on all engines,
overlapping rank 0's broadcast: pack + send), finish (`/finish_weight_update` with the version).
Seen from each engine (`grpod_weight_transfer_status`): waiting for chunks, loading them
(`load_weights`), finalising the layerwise reload. After the last sync of each configuration the
engines' prompt logprobs are compared with the trainer's (HF fp32).

    PYTHONPATH=. .venv/bin/python bench/weight_transfer.py [OUT.json] [--syncs 5] [--groups 3]

Writes OUT.json (default bench/results/weight_transfer.json) and prints a table (median, min–max).
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
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import AutoTokenizer, Qwen2ForCausalLM  # noqa: E402

from grpod.bridges.probe import probe_sequences  # noqa: E402
from grpod.config import InferenceConfig, ModelConfig  # noqa: E402
from grpod.inference.process import InferenceProcess  # noqa: E402
from grpod.models.tiny import build_model, save_model  # noqa: E402
from grpod.weights.transfer import (  # noqa: E402
    ENGINE_EXTENSION,
    EngineWeightClient,
    TransferConfig,
    engine_launch_args,
    iter_state,
    open_weight_group,
)

CONFIGS = [  # (engines, chunk bytes)
    (1, 64 << 20),
    (2, 64 << 20),
    (1, 256 << 10),
    (2, 256 << 10),
]
TRAINER_PHASES = ("formation_s", "start_s", "update_s", "broadcast_s", "pack_s", "finish_s", "total_s")
ENGINE_PHASES = ("receive_wait_s", "load_s", "finalize_s", "engine_total_s")


@torch.no_grad()
def hf_scores(model, sequences):
    out = []
    for ids in sequences:
        x = torch.tensor([ids])
        logprobs = model(input_ids=x).logits[0, :-1].log_softmax(-1)
        out.append(logprobs.gather(-1, x[0, 1:, None])[:, 0].tolist())
    return out


async def engine_status(process: InferenceProcess) -> dict:
    async with process.client() as client:
        (state,) = await client.collective_rpc("grpod_weight_transfer_status")
    return state["last_update"]


async def measure(engines: list[InferenceProcess], model, chunk_bytes: int, groups: int, syncs: int, probe_ids) -> dict:
    cfg = TransferConfig(chunk_bytes=chunk_bytes, timeout_s=120)
    records = []
    gen = torch.Generator().manual_seed(chunk_bytes + len(engines))
    for g in range(groups):
        clients = [EngineWeightClient.for_process(p) for p in engines]
        async with open_weight_group(clients, cfg) as group:
            for s in range(syncs):
                with torch.no_grad():  # a training step's worth of change
                    for param in model.parameters():
                        param.add_(torch.randn(param.shape, generator=gen) * 1e-3)
                named = list(iter_state(model))
                timings = await group.sync(named, weight_version=f"{g}.{s}")
                states = [await engine_status(p) for p in engines]
                slowest = max(states, key=lambda st: st["total_s"])
                records.append(
                    {
                        "formation_s": group.formation_s if s == 0 else None,
                        "start_s": timings.start_s,
                        "update_s": timings.update_s,
                        "broadcast_s": timings.broadcast.total_s,
                        "pack_s": timings.broadcast.pack_s,
                        "finish_s": timings.finish_s,
                        "total_s": timings.total_s,
                        "receive_wait_s": slowest["receive_wait_s"],
                        "load_s": slowest["load_s"],
                        "finalize_s": slowest["finalize_s"],
                        "engine_total_s": slowest["total_s"],
                        "chunks": timings.broadcast.chunks,
                        "bytes": timings.broadcast.bytes,
                    }
                )
    want = hf_scores(model, probe_ids)
    diffs = []
    for process in engines:
        async with process.client() as client:
            await client.reset_prefix_cache()
            got = await client.score_many(probe_ids)
        diffs.append(max(abs(a - b) for ra, rb in zip(got, want) for a, b in zip(ra, rb)))
    return {"records": records, "probe_max_abs_diff": max(diffs)}


def summarise(records: list[dict]) -> dict:
    out = {}
    for key in (*TRAINER_PHASES, *ENGINE_PHASES):
        values = [r[key] for r in records if r.get(key) is not None]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}
    return out


async def run(args) -> dict:
    results: dict = {"configs": []}
    with tempfile.TemporaryDirectory(prefix="grpod-wt-bench-") as tmp:
        model_dir = Path(tmp) / "tiny"
        built, tokenizer = build_model(seed=0)
        save_model(built, tokenizer, model_dir)
        probe_ids = probe_sequences(AutoTokenizer.from_pretrained(model_dir))
        model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        results["model_bytes"] = sum(t.numel() * t.element_size() for _, t in iter_state(model))
        engines = [
            InferenceProcess(
                InferenceConfig(start_timeout_s=400.0, request_timeout_s=60.0, extra_args=engine_launch_args("gloo")),
                ModelConfig(path=model_dir),
                Path(tmp) / f"engine-{i}",
            )
            for i in range(max(n for n, _ in CONFIGS))
        ]
        try:
            began = time.perf_counter()
            async with anyio.create_task_group() as group:
                for process in engines:
                    group.start_soon(lambda p=process: p.start(model_dir, worker_extension=ENGINE_EXTENSION))
            results["engines_up_s"] = time.perf_counter() - began
            for n, chunk_bytes in CONFIGS:
                measured = await measure(engines[:n], model, chunk_bytes, args.groups, args.syncs, probe_ids)
                results["configs"].append(
                    {"engines": n, "chunk_bytes": chunk_bytes, "summary": summarise(measured["records"]), **measured}
                )
                print(f"{n} engine(s), chunks of {chunk_bytes} B: done", file=sys.stderr)
        finally:
            for process in engines:
                await process.stop()
    return results


def ms(stat: dict) -> str:
    return f"{stat['median'] * 1000:.1f} ({stat['min'] * 1000:.1f}–{stat['max'] * 1000:.1f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", type=Path, default=ROOT / "bench" / "results" / "weight_transfer.json")
    parser.add_argument("--syncs", type=int, default=5, help="syncs per group")
    parser.add_argument("--groups", type=int, default=3, help="groups formed per configuration")
    args = parser.parse_args()
    results = anyio.run(run, args)
    print(f"tiny model: {results['model_bytes'] / 2**20:.2f} MiB fp32; engines up in {results['engines_up_s']:.0f} s")
    print("ms: median (min–max); engine columns: the slowest engine of each sync")
    print(
        "| engines | chunk | chunks | formation | start | update | ↳ broadcast (rank 0) | ↳ pack | finish | **total sync** "
        "| engine: wait chunks | engine: load | engine: finalize | probe max diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in results["configs"]:
        s = c["summary"]
        chunk = f"{c['chunk_bytes'] >> 20} MiB" if c["chunk_bytes"] >= 1 << 20 else f"{c['chunk_bytes'] >> 10} KiB"
        print(
            f"| {c['engines']} | {chunk} | {c['records'][0]['chunks']} | {ms(s['formation_s'])} | {ms(s['start_s'])} "
            f"| {ms(s['update_s'])} | {ms(s['broadcast_s'])} | {ms(s['pack_s'])} | {ms(s['finish_s'])} | **{ms(s['total_s'])}** "
            f"| {ms(s['receive_wait_s'])} | {ms(s['load_s'])} | {ms(s['finalize_s'])} | {c['probe_max_abs_diff']:.1e} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
