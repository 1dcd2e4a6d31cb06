"""Pool the seeds of several `compare.py` invocations of one timed task into one table.

    python bench/peers/pool.py bench/results/peers-X-seed0.json bench/results/peers-X-seeds12.json [--out pooled.json]
        [--rename FILE:SIDE=NAME ...]

A task's seeds are often run at different times (each seed takes 35-40 minutes here). Each JSON
keeps, per run and per time mark, the evaluator's outcome on every held-out row (`rows`). This
prints, per mark: each seed's accuracy per side, all seeds' rows together with their 95 % Wilson
interval, and the first side minus the second on the same rows, with its 95 % interval, over the
seeds that recorded per-row outcomes for both sides (`bench/stats.py`'s `paired_difference`);
then the seeds' steps, tokens/s and gradient share. The files must be of one task and one
held-out set, or of tasks scored on the same held-out rows (another training set: the starting
model's outcome on every row is the same in both); a seed may appear in one file only, per side. `--rename` names a side of one file
otherwise (e.g. `peers-X-frontier-seed0.json:grpod=grpod frontier`, a grpod-only run with another
setting): renamed sides come first, so the paired difference is theirs minus the next side's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.stats import paired_difference, wilson  # noqa: E402


def parse_renames(texts: list[str]) -> dict[tuple[str, str], str]:
    """`FILE:SIDE=NAME` -> {(file name, side): NAME}."""
    renames = {}
    for text in texts:
        where, sep, name = text.partition("=")
        file, colon, side = where.rpartition(":")
        if not (sep and colon and file and side and name):
            sys.exit(f"pool: --rename {text!r}: expected FILE:SIDE=NAME")
        renames[(Path(file).name, side)] = name
    return renames


def _same_rows(one: dict, other: dict) -> bool:
    """Two tasks scored on the same held-out rows (another training set, say): the evaluator gave
    the starting model the same outcome on every row of both."""
    rows = [(data.get("start_accuracy") or {}).get("rows") for data in (one, other)]
    return rows[0] is not None and rows[0] == rows[1]


def load(paths: list[Path], renames: dict[tuple[str, str], str] | None = None) -> tuple[dict, dict[tuple[str, int], dict]]:
    """The first file's header (its sides after the renamed ones) and every run by (side, seed)."""
    renames = renames or {}
    header, runs = None, {}
    for path in paths:
        data = json.loads(path.read_text())
        if header is None:
            header = dict(data)
        elif data["task"] != header["task"] and not _same_rows(data, header):
            sys.exit(f"pool: {path} is task {data['task']!r}, {paths[0]} is {header['task']!r}, and their "
                     "starting models did not score the same held-out rows alike")
        for run in data["runs"]:
            side = renames.get((path.name, run["side"]), run["side"])
            key = (side, run["seed"])
            if key in runs:
                sys.exit(f"pool: {key[0]} seed {key[1]} is in {path} and in an earlier file")
            runs[key] = {**run, "side": side, "file": path.name}
    renamed = list(dict.fromkeys(renames.values()))
    header["sides"] = renamed + [s for s in header["sides"] if s not in renamed]
    return header, runs


def saved_at(run: dict, mark: float) -> dict | None:
    """The weights saved at `mark` and scored (a mark whose evaluation failed has no "correct")."""
    return next((s for s in run.get("saved") or [] if s.get("minutes") == mark and "correct" in s), None)


def pool(header: dict, runs: dict[tuple[str, int], dict]) -> dict:
    sides = [s for s in header["sides"] if any(side == s for side, _ in runs)]
    seeds = sorted({seed for _, seed in runs})
    marks = sorted({s["minutes"] for r in runs.values() for s in r.get("saved") or [] if "correct" in s})
    out = {"task": header["task"], "sides": sides, "seeds": seeds, "start_accuracy": header.get("start_accuracy"),
           "marks": []}
    for mark in marks:
        row = {"minutes": mark, "per_seed": {}, "pooled": {}}
        for side in sides:
            got = [saved_at(runs[(side, seed)], mark) if (side, seed) in runs else None for seed in seeds]
            row["per_seed"][side] = [s["accuracy"] if s else None for s in got]
            scored = [s for s in got if s]
            correct, size = sum(s["correct"] for s in scored), sum(s["size"] for s in scored)
            row["pooled"][side] = {"correct": correct, "size": size, "accuracy": correct / size if size else None,
                                   "wilson": wilson(correct, size) if size else None}
        if len(sides) >= 2:
            first, other = sides[0], sides[1]
            pairs, paired_seeds = [], []
            for seed in seeds:
                a = saved_at(runs.get((first, seed), {}), mark)
                b = saved_at(runs.get((other, seed), {}), mark)
                if a and b and a.get("rows") and b.get("rows"):
                    pairs.append((a["rows"], b["rows"]))
                    paired_seeds.append(seed)
            if pairs:
                mean, low, high = paired_difference(pairs)
                row["paired"] = {"minus": f"{first} - {other}", "seeds": paired_seeds, "rows": len(pairs[0][0]),
                                 "mean": mean, "low": low, "high": high}
        out["marks"].append(row)
    out["runs"] = {f"{side} seed {seed}": {
        "file": r["file"], "steps": r.get("steps"), "sampled_tokens_per_s": r.get("sampled_tokens_per_s"),
        "gradient_token_share": r.get("gradient_token_share"), "first_step_s": r.get("first_step_s"),
        "steps_at": {s["minutes"]: s.get("step") for s in r.get("saved") or []},
    } for (side, seed), r in sorted(runs.items())}
    return out


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(pooled: dict) -> str:
    sides, seeds = pooled["sides"], pooled["seeds"]
    seeds_text = " / ".join(str(s) for s in seeds)
    lines = [f"| task `{pooled['task']}`, seeds {seeds_text} | " + " | ".join(sides) + " |",
             "|---|" + "---|" * len(sides)]
    start = pooled.get("start_accuracy")
    if start:
        low, high = wilson(start["correct"], start["size"])
        lines.append(f"| held-out accuracy at start ({start['size']} rows) | {start['accuracy']:.3f} [{low:.3f}, {high:.3f}] |"
                     + " same model |" * (len(sides) - 1))
    for row in pooled["marks"]:
        m = f"{row['minutes']:g} min"
        lines.append(f"| at {m}, per seed | " + " | ".join(
            " / ".join(_fmt(a) for a in row["per_seed"][side]) for side in sides) + " |")
        cells = []
        for side in sides:
            p = row["pooled"][side]
            cells.append("-" if p["accuracy"] is None else
                         f"{p['accuracy']:.3f} [{p['wilson'][0]:.3f}, {p['wilson'][1]:.3f}] ({p['correct']}/{p['size']})")
        lines.append(f"| at {m}, seeds' rows together (95 % Wilson) | " + " | ".join(cells) + " |")
        if "paired" in row:
            p = row["paired"]
            lines.append(f"| at {m}, {p['minus']} on the same rows (95 %, seed{'s' if len(p['seeds']) > 1 else ''} {', '.join(map(str, p['seeds']))}) | "
                         f"{p['mean']:+.3f} [{p['low']:+.3f}, {p['high']:+.3f}] |" + " |" * (len(sides) - 1))
    last = max((row["minutes"] for row in pooled["marks"]), default=None)
    cells = []
    for side in sides:
        values = [pooled["runs"].get(f"{side} seed {seed}", {}).get("steps_at", {}).get(last) for seed in seeds]
        cells.append(" / ".join(_fmt(v, "d") for v in values))
    if last is not None:
        lines.append(f"| steps by {last:g} min, per seed | " + " | ".join(cells) + " |")
    for label, key, spec in (("sampled tokens/s", "sampled_tokens_per_s", ".1f"),
                             ("share of sampled tokens that reached a gradient", "gradient_token_share", ".3f")):
        cells = []
        for side in sides:
            values = [pooled["runs"].get(f"{side} seed {seed}", {}).get(key) for seed in seeds]
            cells.append(" / ".join(_fmt(v, spec) for v in values))
        lines.append(f"| {label}, per seed | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, help="also write the pooled figures as JSON")
    parser.add_argument("--rename", action="append", default=[], metavar="FILE:SIDE=NAME",
                        help="call SIDE of FILE NAME (it comes first)")
    args = parser.parse_args()
    pooled = pool(*load(args.files, parse_renames(args.rename)))
    print(markdown(pooled))
    if args.out:
        args.out.write_text(json.dumps(pooled, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
