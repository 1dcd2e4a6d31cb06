"""Frontier sampling's estimate (`grpod.rollouts.frontier`): the chance that a row's next group
carries a signal, from its pass counts, against sampling; what counts as high; the floor."""

from __future__ import annotations

import random

import pytest

from grpod.rollouts.frontier import FrontierSampling, high_low, signal_chance


def sampled_chance(high: float, low: float, size: int, draws: int = 50_000) -> float:
    """The same chance by sampling p from the posterior and a group of `size` from p."""
    rng = random.Random(0)
    mixed = 0
    for _ in range(draws):
        p = rng.betavariate(high + 0.5, low + 0.5)
        passes = sum(rng.random() < p for _ in range(size))
        mixed += 0 < passes < size
    return mixed / draws


@pytest.mark.parametrize(("high", "low", "size"), [(4, 4, 8), (1, 7, 8), (0, 8, 8), (0, 12, 8), (2, 0, 4)])
def test_the_closed_form_chance_matches_sampling(high, low, size):
    assert signal_chance(high, low, size) == pytest.approx(sampled_chance(high, low, size), abs=0.012)


def test_high_counts_what_differs_from_the_lowest_score():
    assert high_low([0.0, 1.0, 1.0, 0.0]) == (2, 2)
    assert high_low([0.01, 0.01, 1.0]) == (1, 2)  # partial credit: the trainer learns from the difference
    assert high_low([1.0, 1.0, 1.0]) == (0, 3)  # solved and unsolved alike: no signal
    assert high_low([0.5, 0.5 + 1e-12]) == (0, 2)  # float noise is not a difference


def test_weights_order_rows_by_their_chance_and_never_fall_below_the_floor():
    frontier = FrontierSampling(floor=0.05, seed=0, size=8)
    assert frontier.weight(3) == 1.0 and frontier.keeps(3, epoch=0)  # never visited
    frontier.observe(0, [1.0] * 4 + [0.0] * 4)
    frontier.observe(1, [1.0] + [0.0] * 7)
    for _ in range(6):
        frontier.observe(2, [0.0] * 8)
    assert frontier.weight(0) > 0.95 > frontier.weight(1) > 0.5 > 0.2 > frontier.weight(2) > 0.05
    frontier.observe(0, [0.0] * 8)  # one flat visit after a mixed one: earlier counts scaled by 3/4
    assert frontier.state()["0"] == [3.0, 11.0]
    weight = frontier.weight(2)
    kept = sum(frontier.keeps(2, epoch) for epoch in range(4000)) / 4000
    assert kept == pytest.approx(weight, abs=0.03)
    resumed = FrontierSampling(floor=0.05, seed=0, size=8, state=frontier.state())
    assert [resumed.keeps(i, e) for i in range(3) for e in range(50)] == [frontier.keeps(i, e) for i in range(3) for e in range(50)]
    floored = FrontierSampling(floor=0.3, seed=0, size=8, state=frontier.state())
    assert floored.weight(2) == 0.3 and floored.weight(0) == frontier.weight(0)
