"""What running reward functions in worker processes costs per group (`grpod.rollouts.reward_pool`).

Scores the same groups three ways and times each group's scoring:
- `thread`: the function called in a worker thread of the daemon (`anyio.to_thread`), what grpod
  did before reward workers (a hang was abandoned, a regex froze the loop, a crash killed it);
- `pool`: the function in grpod's `RewardScorer` with its `RewardPool` (2 worker processes), as
  the dataset source calls it now;
- for scale, the time the daemon spends per group generating: a group of 8 completions from the
  tiny model takes ~5-20 ms of vLLM time on this machine, one of SmolLM2 (64 tokens) ~3-10 s
  (bench/engine_batch.py, bench/peers/README.md).

Functions: `exact`-like user code (a list comprehension), the `math` builtin (math-verify parses
and compares every completion), and a TRL-style module with four functions (the shipped example).
`--concurrency` groups are scored at once, as the source's requests would.

    .venv/bin/python bench/reward_pool.py [--groups 400] [--concurrency 4] [--out bench/results/reward_pool.json]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpod.config import RewardFunctionConfig  # noqa: E402
from grpod.rollouts.rewards import TrainerState, checked_rewards, combine, resolve_function, reward_functions  # noqa: E402
from grpod.rollouts.scoring import RewardCall, RewardScorer  # noqa: E402

USER = "def exact_user(completions, answer, **kwargs):\n    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]\n"
EXAMPLE = ROOT / "etc" / "examples" / "trl-rewards" / "rewards.py"


def math_without_timeouts(completions, answer, **kwargs):
    """The `math` builtin as it ran in a thread before: math-verify's SIGALRM timeouts off."""
    from math_verify import parse, verify

    rewards = []
    for completion, gold in zip(completions, answer):
        g, c = parse(str(gold), parsing_timeout=None), parse(completion, parsing_timeout=None)
        rewards.append(1.0 if g and c and verify(g, c, timeout_seconds=None) else 0.0)
    return rewards


def workloads(tmp: Path) -> dict[str, tuple[list[dict], bool]]:
    """name -> (function configs, conversational)."""
    (tmp / "user.py").write_text(USER)
    return {
        "user function (list comprehension)": ([{"function": f"{tmp / 'user.py'}:exact_user"}], False),
        "math builtin (math-verify)": ([{"function": "math"}], False),
        "TRL-style module, 4 functions": (
            [{"function": f"{EXAMPLE}:{name}"} for name in ("correct", "reward_len", "digits_only", "carry_bonus")], True,
        ),
    }


def group_call(index: int, size: int, conversational: bool) -> RewardCall:
    a, b = index % 97, (index * 7) % 89
    texts = [f"{a + b + (i % 3)}" if i % 2 else f"The sum is {a + b}." for i in range(size)]
    prompt = f"{a}+{b}="
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    prompts = [[{"role": "user", "content": prompt}]] * size if conversational else [prompt] * size
    return RewardCall(prompts=prompts, completions=completions, completion_ids=[[1, 2, 3]] * size,
                      columns={"answer": [str(a + b)] * size}, trainer_state=TrainerState())


async def time_groups(score, calls: list[RewardCall], concurrency: int) -> list[float]:
    times: list[float] = []
    limiter = anyio.Semaphore(concurrency)

    async def one(call: RewardCall) -> None:
        async with limiter:
            started = time.perf_counter()
            await score(call)
            times.append(time.perf_counter() - started)

    async with anyio.create_task_group() as tg:
        for call in calls:
            tg.start_soon(one, call)
    return times


async def measure(specs: list[dict], conversational: bool, groups: int, size: int, concurrency: int) -> dict:
    functions = reward_functions([RewardFunctionConfig(**s) for s in specs])
    calls = [group_call(i, size, conversational) for i in range(groups)]
    resolved = [math_without_timeouts if f.function == "math" else resolve_function(f.function, f.pattern)
                for f in functions]

    def in_thread(call: RewardCall):
        per = []
        for f, fn in zip(functions, resolved):
            returned = fn(**call.kwargs(), log_metric=lambda *a: None, log_extra=lambda *a: None)
            if inspect.isawaitable(returned):
                returned = asyncio.run(returned)
            per.append(checked_rewards(f.name, returned, len(call.completions)))
        return combine(per, [f.weight for f in functions], "sum")

    async def thread_score(call: RewardCall):
        return await anyio.to_thread.run_sync(in_thread, call)

    await time_groups(thread_score, calls[:20], concurrency)  # imports warmed
    thread = await time_groups(thread_score, calls, concurrency)
    scorer = RewardScorer(functions, aggregation="sum", timeout_s=30, workers=2, memory_mb=2048)
    began = time.perf_counter()
    await scorer.start()
    start_s = time.perf_counter() - began
    try:
        await time_groups(scorer.score, calls[:20], concurrency)
        pool = await time_groups(scorer.score, calls, concurrency)
    finally:
        await scorer.aclose()

    def summary(times: list[float]) -> dict:
        return {"median_ms": round(1000 * statistics.median(times), 3),
                "p90_ms": round(1000 * statistics.quantiles(times, n=10)[8], 3),
                "max_ms": round(1000 * max(times), 3)}

    return {"thread": summary(thread), "pool": summary(pool), "pool_start_s": round(start_s, 2),
            "overhead_median_ms": round(1000 * (statistics.median(pool) - statistics.median(thread)), 3)}


async def main(args: argparse.Namespace) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (specs, conversational) in workloads(Path(tmp)).items():
            results[name] = await measure(specs, conversational, args.groups, args.group_size, args.concurrency)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=400)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "reward_pool.json")
    args = parser.parse_args()
    results = anyio.run(main, args)
    print(f"per-group scoring time, {args.groups} groups of {args.group_size}, {args.concurrency} at once")
    print(f"| functions | thread median / p90 (ms) | pool median / p90 (ms) | pool overhead, median (ms) | pool start (s) |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['thread']['median_ms']} / {r['thread']['p90_ms']} | {r['pool']['median_ms']} / "
              f"{r['pool']['p90_ms']} | {r['overhead_median_ms']} | {r['pool_start_s']} |")
    args.out.write_text(json.dumps({"groups": args.groups, "group_size": args.group_size,
                                    "concurrency": args.concurrency, "results": results}, indent=1) + "\n")
    print(f"written: {args.out}")
