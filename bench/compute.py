"""Compute near the machine's limit? The floating-point work of a grpod run on a Llama-style model,
split by generation and training, against this machine's measured fp32 matmul peak.

    .venv/bin/python bench/compute.py RUN_DIR [RUN_DIR ...] [--model models/smollm2-135m] [--size 1024]

The peak: the best of `--repeat` fp32 `torch.matmul` of two SIZE x SIZE matrices, with 1 and with
2 torch threads (nothing else should run meanwhile). A run directory needs metrics.jsonl and
rollouts.jsonl (`run.record_rollouts = true`): what a step record counts (`sampled_tokens`,
`train_s`, `step_s`) and what the trained groups hold (prompt and completion lengths).

FLOPs, from the model's config.json (2 per multiply-add; norms, activations, softmax and the
optimizer left out: they are a few per cent of the matmuls here):
- a forward of one token at context length t: 2 x (the linear layers' weights, the output
  projection onto the vocabulary included) + 4 x layers x heads x head_dim x t (attention's
  scores and weighted sum);
- generation: each request's prompt once in full, and again for each of its other n - 1
  completions but for the prompt's whole KV blocks that vLLM's prefix cache gives them (it
  shares whole blocks only, and always computes the prompt's last token): the block is the run's
  `--block-size` (its vllm.log launch line; vLLM's CPU default, 128, when absent). Prompts shared
  across groups (a system prompt) are counted in every group: an upper bound. Then every sampled
  completion token one forward at its position. Completions of the groups that
  never reached the trainer (filtered, stale) are in `sampled_tokens` but not in rollouts.jsonl:
  they are counted at the trained groups' mean prompt and completion lengths;
- training: forward and backward of every step (3 x its forward: the backward is twice the
  forward) as the trainer ran it: the positions it forwarded (the step record's `processed_tokens`:
  padding included where rows are padded; with `train.share_prompt` a group packed, its prompt once)
  through the linear layers, and attention over each trained sequence's context (the groups
  rollouts.jsonl records for that step whose scores differ; a shared prompt's context once per
  group). Records without `processed_tokens` count every trained sequence in full.
Rates: generation over the span from the first to the last step record (the engine generates all
the time on its own thread), training over the steps' `train_s` (the trainer's own thread).
Prints one table per run and writes `--out` (default bench/results/compute.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def matmul_peak(size: int, threads: int, repeat: int) -> float:
    """Best fp32 matmul FLOP/s with `threads` torch threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.matmul(a, b)
    best = 0.0
    for _ in range(repeat):
        began = time.perf_counter()
        torch.matmul(a, b)
        best = max(best, 2 * size**3 / (time.perf_counter() - began))
    return best


class Flops:
    """Forward FLOPs of a Llama-style decoder from its config.json."""

    def __init__(self, config: dict) -> None:
        h, layers = config["hidden_size"], config["num_hidden_layers"]
        heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
        head_dim = config.get("head_dim", h // heads)
        per_layer = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * config["intermediate_size"]
        self.linear = layers * per_layer + h * config["vocab_size"]  # the output projection (tied or not)
        self.attention = 4 * layers * heads * head_dim

    @staticmethod
    def context(tokens: int, start: int = 0) -> float:
        """The attended positions of `tokens` tokens at positions start, start+1, ... (causal)."""
        return tokens * start + tokens * (tokens + 1) / 2

    def forward(self, tokens: int, start: int = 0) -> float:
        """A forward of `tokens` tokens at positions start, start+1, ... (causal attention)."""
        return 2 * self.linear * tokens + self.attention * self.context(tokens, start)


# vLLM's KV block on a CPU when the launch names none.
CPU_DEFAULT_BLOCK = 128


def block_size(run_dir: Path) -> int:
    """The engine's KV block: `--block-size` on the launch line in vllm.log, else vLLM's CPU default."""
    log = run_dir / "vllm.log"
    for line in (log.read_text(errors="replace").splitlines() if log.exists() else []):
        if line.startswith("=== grpod launch") and "--block-size" in line:
            words = line.split()
            return int(words[words.index("--block-size") + 1])
    return CPU_DEFAULT_BLOCK


def prefill_flops(flops: Flops, prompt: int, group_size: int, block: int) -> float:
    """One group request's prompt work: in full once, then the uncached tail per other completion."""
    cached = (prompt - 1) // block * block
    return flops.forward(prompt) + (group_size - 1) * flops.forward(prompt - cached, start=cached)


def prompt_length(group: dict) -> int:
    mask = group["loss_mask"][0]
    return mask.index(1) if 1 in mask else len(group["tokens"][0])


def training_flops(flops: Flops, step: dict, groups: list[dict]) -> float:
    """One step's forward and backward as the trainer ran it (module docstring)."""
    trained = [g for g in groups if len(set(g["scores"])) > 1]  # a zero-variance group is dropped
    shared = step.get("shared_prompt_tokens", 0) > 0
    positions, context = 0, 0.0
    for g in trained:
        prompt = prompt_length(g)
        if shared:
            positions += prompt
            context += flops.context(prompt)
        for tokens in g["tokens"]:
            positions += len(tokens) - prompt if shared else len(tokens)
            context += flops.context(len(tokens) - prompt, start=prompt) if shared else flops.context(len(tokens))
    forwarded = step.get("processed_tokens", positions)
    return 3 * (2 * flops.linear * forwarded + flops.attention * context)


def analyse(run_dir: Path, flops: Flops) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_s" in r]
    recorded = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    groups = [r["group"] for r in recorded]
    by_step: dict[int, list[dict]] = {}
    for r in recorded:
        by_step.setdefault(r["step"], []).append(r["group"])
    if len(steps) < 2 or not groups:
        raise SystemExit(f"{run_dir}: needs two step records and rollouts.jsonl")
    span = steps[-1]["time"] - steps[0]["time"]
    # Only the steps after the first: the span's work.
    window = steps[1:]
    prompt_lengths, completion_lengths = [], []
    for g in groups:
        prompt = prompt_length(g)
        prompt_lengths.append(prompt)
        completion_lengths += [len(tokens) - prompt for tokens in g["tokens"]]
    train_flops = sum(training_flops(flops, s, by_step.get(s["step"], [])) for s in window)
    mean_prompt = sum(prompt_lengths) / len(prompt_lengths)
    mean_completion = sum(completion_lengths) / len(completion_lengths)
    sampled = window[-1].get("sampled_tokens", 0) - steps[0].get("sampled_tokens", 0)
    group_size = len(groups[0]["tokens"])
    requests = sampled / (mean_completion * group_size)
    block = block_size(run_dir)
    prefill = requests * sum(prefill_flops(flops, n, group_size, block) for n in prompt_lengths) / len(prompt_lengths)
    decode = sampled * (2 * flops.linear + flops.attention * (mean_prompt + mean_completion / 2))
    train_s = sum(s["train_s"] for s in window)
    return {
        "run": str(run_dir), "steps": len(window), "span_s": round(span, 1), "train_s": round(train_s, 1),
        "sampled_tokens": sampled, "block_size": block, "mean_prompt": round(mean_prompt, 1), "mean_completion": round(mean_completion, 1),
        "generation_flops": prefill + decode, "prefill_flops": prefill, "train_flops": train_flops,
        "generation_flops_per_s": (prefill + decode) / span, "train_flops_per_s": train_flops / train_s if train_s else None,
        "train_share_of_span": train_s / span, "flops_per_step": (prefill + decode + train_flops) / len(window),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "compute.json")
    args = parser.parse_args()
    flops = Flops(json.loads((args.model / "config.json").read_text()))
    peak = {threads: matmul_peak(args.size, threads, args.repeat) for threads in (1, 2)}
    print(f"fp32 matmul peak ({args.size}x{args.size}, best of {args.repeat}): "
          f"1 thread {peak[1] / 1e9:.1f} GFLOP/s, 2 threads {peak[2] / 1e9:.1f} GFLOP/s ({platform.processor() or platform.machine()})")
    print(f"model {args.model.name}: {flops.linear / 1e6:.1f} M multiply-adds per token in its linear layers "
          f"(output projection included)\n")
    results = []
    print("| run | steps | GFLOP per step (gen / train) | generation GFLOP/s (of 1-thread peak) | "
          "training GFLOP/s while training (of 1-thread peak) | trainer busy | whole run (of 2-thread peak) |")
    print("|---|---|---|---|---|---|---|")
    for run_dir in args.runs:
        r = analyse(run_dir, flops)
        results.append(r)
        total = (r["generation_flops"] + r["train_flops"]) / r["span_s"]
        print(f"| {run_dir.name} | {r['steps']} | {r['generation_flops'] / r['steps'] / 1e9:.0f} / "
              f"{r['train_flops'] / r['steps'] / 1e9:.0f} | {r['generation_flops_per_s'] / 1e9:.1f} "
              f"({r['generation_flops_per_s'] / peak[1]:.0%}) | {(r['train_flops_per_s'] or 0) / 1e9:.1f} "
              f"({(r['train_flops_per_s'] or 0) / peak[1]:.0%}) | {r['train_share_of_span']:.0%} | "
              f"{total / 1e9:.1f} ({total / peak[2]:.0%}) |")
    args.out.write_text(json.dumps({"peak_flops": peak, "size": args.size, "runs": results}, indent=2))
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
