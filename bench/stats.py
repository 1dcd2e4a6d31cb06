"""Statistics the benchmarks share."""

from __future__ import annotations

import math


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of `correct` successes in `n`."""
    if n == 0:
        return (0.0, 1.0)
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_difference(pairs: list[tuple[list[int], list[int]]], z: float = 1.96) -> tuple[float, float, float]:
    """The mean difference A - B in accuracy, and its 95 % interval, of two sides scored on the
    same held-out rows: `pairs` holds one (A's outcomes, B's outcomes) per seed, each a 0/1 list
    over the same rows in the same order. The row is the independent unit: each row's difference
    is averaged over the seeds first (every seed scores the same rows, so seeds of one row are not
    independent draws), and the interval is the normal one on the mean of those row differences.
    Pairing removes the rows' own difficulty from the comparison, so it is narrower than two
    Wilson intervals side by side whenever the sides tend to get the same rows right."""
    if not pairs:
        raise ValueError("no pairs")
    n = len(pairs[0][0])
    if n < 2 or any(len(a) != n or len(b) != n for a, b in pairs):
        raise ValueError("every side of every seed must score the same rows (at least two)")
    by_row = [sum(a[i] - b[i] for a, b in pairs) / len(pairs) for i in range(n)]
    mean = sum(by_row) / n
    spread = math.sqrt(sum((d - mean) ** 2 for d in by_row) / (n - 1) / n)
    return mean, mean - z * spread, mean + z * spread
