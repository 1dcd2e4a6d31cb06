"""One evaluator for both sides' weights: greedy held-out accuracy of saved model directories.

    python bench/peers/evaluate.py --config CFG [--set K=V ...] [--threads 2] DIR [DIR ...]

Every DIR (a Hugging Face model directory: grpod's checkpoint `model/`, TRL's saved weights, or
the starting model) is loaded in fp32 and scored by `workload.held_out_accuracy`: the same
held-out rows (`eval.size` of `eval.dataset`, or the builtin task's held-out set), prompts, greedy
HF generate, completion budget, reward and correctness rule for every directory. Prints one JSON
line per DIR: {"weights", "correct", "size", "accuracy", "mean_score" (the mean reward, partial
credit included), "functions" (per reward function: the rows it gave full credit, its mean
reward), "rows" (each held-out row's outcome in order, 1 correct, 0 not), "eval_s"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=50, help="prompts per greedy generate call")
    parser.add_argument("weights", nargs="+", type=Path)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from workload import Workload, held_out_accuracy, load

    cfg = load(args.config, args.set)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    workload = Workload(cfg, tokenizer)
    held_out = workload.eval_examples()
    for weights in args.weights:
        began = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
        scored = held_out_accuracy(model, tokenizer, workload, held_out, args.batch)
        print(json.dumps({"weights": str(weights), **scored.record(), "eval_s": round(time.perf_counter() - began, 1)}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
