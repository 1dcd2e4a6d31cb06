"""Generation throughput cost of bridge mode `shared`'s CPU linear switch (F.linear instead of
vLLM's oneDNN / SGL kernels).

For each model size, two vLLM servers (CPU build, eager) run on the same checkpoint: stock, and
with grpod's worker extension, whose import switches linear layers to `torch.nn.functional.linear`
over plain weight tensors (what shared weights need; see grpod/weights/shared_ext.py), attached
to a shared buffer as shared mode serves. They are measured alternately (the machine may be
shared). Two loads, each one request (timed after a warm-up), median of `--repeats`:

- `batch`: n = 32 completions of max_tokens tokens (ignore_eos), the rollout shape;
- `single`: n = 1 completion of max_tokens tokens, decode latency bound.

Prints a table and writes bench/results/shared_linear.json.

    .venv/bin/python bench/shared_linear.py [--sizes tiny,medium] [--max-tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import anyio
import structlog
from transformers import AutoModelForCausalLM

from grpod.config import InferenceConfig, ModelConfig
from grpod.inference.process import InferenceProcess
from grpod.models.tiny import build_model, save_model
from grpod.weights.shared_layout import share_parameters

RESULTS = Path(__file__).parent / "results" / "shared_linear.json"
SIZES = {"tiny": {"hidden_size": 128, "layers": 2}, "medium": {"hidden_size": 1024, "layers": 4}}
EXTENSION = "grpod.weights.shared_ext.SharedWeightsExtension"


async def completion_tokens(base_url: str, n: int, max_tokens: int) -> tuple[int, float]:
    body = {"model": "policy", "prompt": [3, 4, 5, 6, 7], "n": n, "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 1.0, "seed": 1}  # fmt: skip
    began = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        async with session.post(base_url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=600)) as r:
            answer = await r.json()
    return answer["usage"]["completion_tokens"], time.perf_counter() - began


async def measure(model_dir: Path, work: Path, max_tokens: int, repeats: int) -> dict[str, dict[str, float]]:
    """Both servers up at once, measured alternately, so that load from elsewhere on the machine
    falls on both alike."""
    servers = {
        name: InferenceProcess(InferenceConfig(start_timeout_s=600.0), ModelConfig(path=model_dir), work / name)
        for name in ("stock", "shared")
    }
    shm = work / "shm"
    try:
        await servers["stock"].start(model_dir)
        await servers["shared"].start(model_dir, worker_extension=EXTENSION)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        share_parameters(model, shm)
        async with servers["shared"].client() as client:
            await client.collective_rpc("attach_shared", args=[str(shm), "true"])
        rates: dict[str, dict[str, list[float]]] = {name: {"batch": [], "single": []} for name in servers}
        for load, n in (("batch", 32), ("single", 1)):
            for name, server in servers.items():
                await completion_tokens(server.base_url, n, max_tokens)  # warm-up
            for i in range(repeats):
                order = list(servers.items()) if i % 2 == 0 else list(servers.items())[::-1]
                for name, server in order:
                    tokens, seconds = await completion_tokens(server.base_url, n, max_tokens)
                    rates[name][load].append(tokens / seconds)
        return {name: {load: statistics.median(v) for load, v in loads.items()} for name, loads in rates.items()}
    finally:
        for server in servers.values():
            await server.stop()
        shutil.rmtree(shm, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="tiny,medium")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    rows = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            model, tokenizer = build_model(seed=0, **SIZES[size])
            params = sum(p.numel() for p in model.parameters())
            model_dir = Path(tmp) / size
            save_model(model, tokenizer, model_dir)
            del model
            result = anyio.run(measure, model_dir, Path(tmp) / size, args.max_tokens, args.repeats)
            stock, shared = result["stock"], result["shared"]
            for load in ("batch", "single"):
                rows.append({
                    "size": size, "params": params, "load": load,
                    "stock_tokens_per_s": round(stock[load], 1), "shared_tokens_per_s": round(shared[load], 1),
                    "change": round(shared[load] / stock[load] - 1, 3),
                })  # fmt: skip
    print(f"{'size':<8}{'params':>12}{'load':>8}{'stock tok/s':>14}{'F.linear tok/s':>16}{'change':>9}")
    for r in rows:
        print(f"{r['size']:<8}{r['params']:>12}{r['load']:>8}{r['stock_tokens_per_s']:>14}"
              f"{r['shared_tokens_per_s']:>16}{r['change']:>+9.1%}")  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "max_tokens": args.max_tokens, "repeats": args.repeats, "rows": rows,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
