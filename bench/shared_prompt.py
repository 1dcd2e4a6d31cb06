"""Trainer step time with each group's prompt forwarded once (`train.share_prompt`) and without.

Replays the batches a real run recorded (`run.record_rollouts = true`: rollouts.jsonl, one line
per trained group) through a fresh trainer on the run's model, the first `--steps` recorded
batches that train (not every group flat), once with `share_prompt = false` and once with `true`,
on `--threads` torch threads (default 1, the trainer's setting in the examples; 2 is what it gets
while an idle engine lends it its core, `train.borrow_engine_cores`), fp32, AdamW at lr 1e-7. Both
settings train the same batches from the same weights; the step time is the trainer's own `step_time_s` (forward, loss, backward, clip,
optimizer), and the first step of each setting is a warm-up, left out of the median.

    .venv/bin/python bench/shared_prompt.py --rollouts RUN_DIR/rollouts.jsonl [...] \
        [--model models/smollm2-135m] [--steps 5] [--threads 1] [--out bench/results/shared_prompt.json]

`--dense-embedding` times instead the packed step with the tied embedding's lookup gradient sparse
(the trainer's setting, `sparse_tied_embedding_gradient`) and dense, two trainers stepping the
same batches in turn (which goes first alternates), `--skip` recorded batches in.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import structlog

from grpod.config import parse_config
from grpod.rollouts.group import RolloutGroup
from grpod.training.trainer import build_trainer

RESULTS = Path(__file__).parent / "results" / "shared_prompt.json"


def recorded_batches(path: Path, steps: int) -> list[list[RolloutGroup]]:
    by_step: dict[int, list[RolloutGroup]] = defaultdict(list)
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]].append(RolloutGroup.from_json(record["group"]))
    # Batches the trainer trains: a batch of flat groups only (every completion scored alike) is skipped.
    trained = [by_step[s] for s in sorted(by_step) if any(len(set(g.scores)) > 1 for g in by_step[s])]
    return trained[:steps]


def timed(model: Path, batches: list[list[RolloutGroup]], share: bool, threads: int) -> dict:
    cfg = parse_config({"train": {"threads": threads, "lr": 1e-7, "share_prompt": share}})
    trainer = build_trainer(cfg, model)
    steps = [trainer.train_step(groups) for groups in batches]
    kept = [s for s in steps[1:] if not s.get("skipped")]
    return {
        "share_prompt": share,
        "threads": threads,
        "step_time_s": [round(s["step_time_s"], 3) for s in steps],
        "median_step_s": round(statistics.median(s["step_time_s"] for s in kept), 3),
        "processed_tokens": sum(s["processed_tokens"] for s in kept),
        "tokens": sum(s["tokens"] for s in kept),
        "loss": [round(s["loss"], 6) for s in steps if "loss" in s],
    }


def embedding_gradient(model: Path, batches: list[list[RolloutGroup]], threads: int) -> dict:
    """Packed steps with the tied lookup's gradient sparse and dense, interleaved batch by batch."""
    cfg = parse_config({"train": {"threads": threads, "lr": 1e-7, "share_prompt": True}})
    trainers = {}
    for sparse in (True, False):
        trainers[sparse] = build_trainer(cfg, model)
        trainers[sparse].model.get_input_embeddings().sparse = sparse
        trainers[sparse].train_step(batches[0])  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    for i, batch in enumerate(batches[1:]):
        for sparse in ((True, False) if i % 2 == 0 else (False, True)):
            times[sparse].append(trainers[sparse].train_step(batch)["step_time_s"])
    ratios = [dense / sparse for sparse, dense in zip(times[True], times[False], strict=True)]
    return {"threads": threads, "sparse_step_s": [round(t, 3) for t in times[True]],
            "dense_step_s": [round(t, 3) for t in times[False]],
            "median_sparse_s": round(statistics.median(times[True]), 3), "median_dense_s": round(statistics.median(times[False]), 3),
            "dense_over_sparse_paired": {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3), "max": round(max(ratios), 3)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=Path, nargs="+", required=True)
    parser.add_argument("--model", type=Path, default=Path("models/smollm2-135m"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="the trainer's torch threads (train.threads)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--dense-embedding", action="store_true", help="sparse against dense tied lookup gradient, packed")
    parser.add_argument("--skip", type=int, default=0, help="recorded trained batches to skip first")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    rows = []
    for path in args.rollouts:
        batches = recorded_batches(path, args.skip + args.steps)[args.skip:]
        if args.dense_embedding:
            rows.append({"rollouts": str(path), "skip": args.skip, "batches": len(batches),
                         **embedding_gradient(args.model, batches, args.threads)})
            args.out.write_text(json.dumps({"model": str(args.model), "rows": rows}, indent=1) + "\n")
            print(f"{path}: packed step {rows[-1]['median_sparse_s']} s with the sparse lookup gradient, "
                  f"{rows[-1]['median_dense_s']} s dense (paired {rows[-1]['dense_over_sparse_paired']})", flush=True)
            continue
        groups = [g for batch in batches for g in batch]
        prompt = statistics.mean(g.loss_mask[0].index(1) for g in groups)
        completion = statistics.mean(sum(m) for g in groups for m in g.loss_mask)
        runs = [timed(args.model, batches, share, args.threads) for share in (False, True)]
        rows.append({"rollouts": str(path), "batches": len(batches), "group_size": len(groups[0].tokens),
                     "mean_prompt_tokens": round(prompt, 1), "mean_completion_tokens": round(completion, 1),
                     "runs": runs, "speedup": round(runs[0]["median_step_s"] / runs[1]["median_step_s"], 2)})
        args.out.write_text(json.dumps({"model": str(args.model), "rows": rows}, indent=1) + "\n")
        print(f"{path} ({args.threads} threads): prompt {prompt:.0f} tokens, completion {completion:.0f}, group {len(groups[0].tokens)}: "
              f"{runs[0]['median_step_s']:.2f} s a step -> {runs[1]['median_step_s']:.2f} s shared "
              f"({rows[-1]['speedup']}x; positions forwarded {runs[0]['processed_tokens']:.0f} -> "
              f"{runs[1]['processed_tokens']:.0f})", flush=True)


if __name__ == "__main__":
    main()
