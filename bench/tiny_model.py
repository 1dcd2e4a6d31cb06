"""What `init_model` produces per seed: held-out accuracy, GRPO group mix, and how long it takes.

For each seed: `init_model` into a temporary directory (default warm-up), then its record: HF
greedy accuracy on all held-out problems, and over groups of 8 completions sampled at T=1 the
share of problems whose group mixes right and wrong answers (the groups GRPO learns from), the
all-wrong share and the sampled accuracy; plus wall time of the whole init (build, warm-up,
evaluation, atomic save) with one torch thread. Prints a table and writes
bench/results/tiny_model.json.

    .venv/bin/python bench/tiny_model.py [--seeds 0,1,2,3] [--warmup-steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import structlog

from grpod.models.tiny import DEFAULT_WARMUP_STEPS, init_model

RESULTS = Path(__file__).resolve().parent / "results" / "tiny_model.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    header = ("seed", "steps", "greedy acc", "sample acc", "mixed", "all wrong", "init s", "load")
    print("{:>4} {:>6} {:>10} {:>10} {:>7} {:>9} {:>7} {:>5}".format(*header))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            record = init_model(Path(tmp) / f"seed{seed}", seed=seed, warmup_steps=args.warmup_steps)
            load = os.getloadavg()[0]  # wall times on a shared machine are only as steady as its load
            sampled = record["sampled"]
            rows.append({**record, "loadavg_1m": load})
            print(
                f"{seed:>4} {record['warmup_steps']:>6} {record['eval_accuracy']:>10.3f} "
                f"{sampled['sample_accuracy']:>10.3f} {sampled['mixed_share']:>7.2f} "
                f"{sampled['all_wrong_share']:>9.2f} {record['seconds']:>7.1f} {load:>5.1f}",
                flush=True,
            )
    summary = {
        "greedy_accuracy_median": statistics.median(r["eval_accuracy"] for r in rows),
        "mixed_share_median": statistics.median(r["sampled"]["mixed_share"] for r in rows),
        "seconds_median": statistics.median(r["seconds"] for r in rows),
    }
    print(", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "bench": "tiny_model",
                "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
                "summary": summary,
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
