"""How much of a run's generation could reach a gradient: the per-visit pass rates behind its
groups, and what sampling schemes would get from them.

    .venv/bin/python bench/signal_bound.py RUN_DIR [RUN_DIR ...] [--threshold 1.0] [--out FILE]

RUN_DIR is a grpod run directory recorded with `run.record_rollouts = true` (bench/peers runs
are). A group carries a learning signal when its completions did not all score alike. This
script looks at the binary side of that: a completion passes when its score is at least
`--threshold` (the eval's `correct_threshold`), and a group is *mixed* when some of its
completions pass and some do not.

What a run records: rollouts.jsonl holds every group of a trained batch (the trainer then drops
the flat ones), so the number of passing completions in each; the last step record's `dynamic_filtered` counts the groups generated and
thrown away for having no signal, whose completions therefore all passed or all failed. From
those counts the script fits the distribution of the pass rate p of the row behind a draw (a
mixture on a grid of p, by maximum likelihood with EM; the filtered groups enter as "all
alike", which p and 1 - p explain equally, so only the symmetric quantities below are reported).
Then, for groups of G completions of equal length:
- signal(G): the share of draws whose group comes out mixed, 1 - p^G - (1 - p)^G averaged over
  the fit; this is the share of generated tokens that reach a gradient when every draw is
  sampled in full (partial credit can add signal to a group that is alike in pass / fail);
- in band: the share of draws whose p makes a group mixed at least 9 times in 10; a sampler that
  knew each row's p and drew only these would keep 90 %;
- screen(k): sample k completions first and the other G - k only when the k are mixed; a draw
  whose k are alike costs k completions and gives nothing. Share = E[mixed(k)] G /
  (E[mixed(k)] G + E[1 - mixed(k)] k).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from grpod.service.logs import read_metrics

GRID = [i / 40 for i in range(41)]
BAND = 0.9  # a draw is "in band" when its group comes out mixed with at least this probability


def mixed(p: float, k: int) -> float:
    """The probability that k completions at pass rate p are not all alike."""
    return 1.0 - p**k - (1.0 - p) ** k


def outcomes(run_dir: Path, threshold: float) -> tuple[int, dict[int, int], dict]:
    """(group size, groups of trained batches by their passing completions, the last step record:
    its `dynamic_filtered` counts the groups thrown away for having no signal) of one run."""
    rollouts = run_dir / "rollouts.jsonl"
    steps = [r for r in read_metrics(run_dir) if r.get("kind") == "step"] if rollouts.exists() else []
    if not steps:
        raise SystemExit(f"{run_dir}: needs step records in metrics.jsonl and rollouts.jsonl (run.record_rollouts)")
    counts: dict[int, int] = {}
    size = 0
    for line in rollouts.read_text().splitlines():
        scores = json.loads(line)["group"]["scores"]
        if size and len(scores) != size:
            raise SystemExit(f"{run_dir}: groups of {size} and of {len(scores)} completions")
        size = len(scores)
        passing = sum(score >= threshold for score in scores)
        counts[passing] = counts.get(passing, 0) + 1
    return size, counts, steps[-1]


def fit(size: int, counts: dict[int, int], filtered: int, rounds: int = 3000) -> list[float]:
    """Weights on GRID of the pass rate behind a draw: the maximum-likelihood mixture (EM) for
    queued groups with j = 1..size-1 passing completions, and all-alike groups (filtered, or
    queued with j = 0 or size: flat, or with signal from partial credit only)."""
    alike = filtered + counts.get(0, 0) + counts.get(size, 0)
    observed = [(counts.get(j, 0), [math.comb(size, j) * p**j * (1 - p) ** (size - j) for p in GRID])
                for j in range(1, size)]
    observed.append((alike, [p**size + (1 - p) ** size for p in GRID]))
    total = sum(n for n, _ in observed)
    if not total:
        raise SystemExit("no groups")
    weights = [1.0 / len(GRID)] * len(GRID)
    for _ in range(rounds):
        new = [0.0] * len(GRID)
        for n, likelihood in observed:
            if not n:
                continue
            joint = [w * lk for w, lk in zip(weights, likelihood)]
            norm = sum(joint)
            if norm > 0:
                for i, value in enumerate(joint):
                    new[i] += n * value / norm
        weights = [value / total for value in new]
    return weights


def screen_share(weights: list[float], size: int, k: int) -> float:
    """The share of generated completions that end in a mixed group when k are sampled first and
    the rest only when those k are mixed (k = size: every draw sampled in full)."""
    go = sum(w * mixed(p, k) for w, p in zip(weights, GRID))
    if k >= size:
        return go
    return go * size / (go * size + (1 - go) * k)


def analyse(run_dir: Path, threshold: float) -> dict:
    size, counts, last = outcomes(run_dir, threshold)
    filtered = int(last.get("dynamic_filtered", 0))
    weights = fit(size, counts, filtered)
    trained = sum(counts.values())
    mixed_trained = sum(n for j, n in counts.items() if 0 < j < size)
    return {
        "run": str(run_dir),
        "group_size": size,
        "groups_queued": trained,
        "groups_filtered": filtered,
        "observed_mixed_share": mixed_trained / (trained + filtered),
        "gradient_token_share": last.get("gradient_token_share"),
        "fit_signal": screen_share(weights, size, size),
        "extreme_draws": sum(w for w, p in zip(weights, GRID) if p <= 0.1 or p >= 0.9),
        "in_band_draws": sum(w for w, p in zip(weights, GRID) if mixed(p, size) >= BAND),
        "screen": {str(k): screen_share(weights, size, k) for k in range(2, size)},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="grpod run directories (run.record_rollouts = true)")
    parser.add_argument("--threshold", type=float, default=1.0, help="a completion passes at this score or above")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    results = [analyse(run, args.threshold) for run in args.runs]
    print("| run | G | groups queued / filtered | mixed share, seen / fitted | gradient_token_share | "
          "draws with p <= 0.1 or >= 0.9 | draws in band | screen k: share |")
    print("|---" * 8 + "|")
    for r in results:
        screens = ", ".join(f"{k}: {share:.2f}" for k, share in sorted(r["screen"].items(), key=lambda kv: int(kv[0])))
        print(f"| {r['run']} | {r['group_size']} | {r['groups_queued']} / {r['groups_filtered']} | "
              f"{r['observed_mixed_share']:.2f} / {r['fit_signal']:.2f} | {r['gradient_token_share']} | "
              f"{r['extreme_draws']:.2f} | {r['in_band_draws']:.2f} | {screens} |")
    if args.out:
        args.out.write_text(json.dumps({"threshold": args.threshold, "band": BAND, "runs": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
