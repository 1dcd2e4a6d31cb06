"""Frontier sampling for the dataset source: draw a row as often as its group is likely to carry
a learning signal (`source.dataset.frontier`).

A group of G completions trains only when they do not all score alike. For a row whose
completions come out "high" with probability p, that happens with probability
1 - p^G - (1 - p)^G: near 1 for a row the policy solves half the time, near 0 for one it always
or never solves. One group says little about p (a row solved 1 time in 10 comes out flat with 8
completions 4 times in 10), so each row keeps a pass-rate estimate over its visits:

- a visit adds the group's high and low completions to the row's counts, after scaling the counts
  of earlier visits by 3/4 (the policy moves; recent visits weigh more). A completion is high when it
  scores above the group's lowest score: that is a pass with a 0/1 reward, and with partial credit
  it counts any difference the trainer would learn from. A flat group adds G low (solved and
  unsolved are alike here: both give nothing);
- the row's weight is the chance that its next group carries a signal, with p drawn from its
  counts under a Jeffreys prior, Beta(high + 1/2, low + 1/2): 1 - E[p^G] - E[(1 - p)^G], both
  moments in closed form. A row never visited weighs 1. The weight never goes below `floor`, so
  every row comes back;
- epoch e still visits the rows in its shuffled order (`grpod.rollouts.dataset`), and keeps row i
  when a uniform draw seeded by (shuffle_seed, e, i) is below its weight; the others are skipped
  for this epoch (counted as `rested`).

The counts ride in the dataset cursor ("frontier": row index -> [high, low]), so a resumed run
weighs its rows as the stopped one did.
"""

from __future__ import annotations

import random

from grpod.rollouts.signal import ZERO_VARIANCE_TOL

PRIOR = 0.5  # Jeffreys: Beta(1/2, 1/2)
DECAY = 0.75  # the weight of earlier visits' counts at each new visit (a memory of about 4 visits)


def beta_moment(a: float, b: float, k: int) -> float:
    """E[p^k] for p ~ Beta(a, b)."""
    moment = 1.0
    for i in range(k):
        moment *= (a + i) / (a + b + i)
    return moment


def signal_chance(high: float, low: float, size: int) -> float:
    """The chance that a group of `size` completions comes out mixed, the row's pass rate drawn
    from Beta(high + PRIOR, low + PRIOR)."""
    a, b = high + PRIOR, low + PRIOR
    return max(0.0, 1.0 - beta_moment(a, b, size) - beta_moment(b, a, size))


def high_low(scores: list[float]) -> tuple[int, int]:
    """(completions above the group's lowest score, the others)."""
    lowest = min(scores)
    high = sum(1 for s in scores if s - lowest > ZERO_VARIANCE_TOL)
    return high, len(scores) - high


class FrontierSampling:
    def __init__(self, floor: float, seed: int, size: int, state: dict | None = None) -> None:
        """`floor`: the least weight of a row (source.dataset.frontier_floor); `seed`: the
        shuffle seed; `size`: the group size; `state`: the cursor's "frontier" entry of a
        resumed run."""
        self.floor = floor
        self.seed = seed
        self.size = size
        self.counts: dict[int, tuple[float, float]] = {
            int(index): (float(high), float(low)) for index, (high, low) in (state or {}).items()
        }

    def weight(self, index: int) -> float:
        """The chance that row `index` is kept in an epoch (1 for a row never visited)."""
        if index not in self.counts:
            return 1.0
        return max(self.floor, signal_chance(*self.counts[index], self.size))

    def keeps(self, index: int, epoch: int) -> bool:
        """Whether epoch `epoch` draws row `index` (the same answer for the same counts)."""
        weight = self.weight(index)
        return weight >= 1.0 or random.Random(f"{self.seed}:{epoch}:{index}:frontier").random() < weight

    def observe(self, index: int, scores: list[float]) -> None:
        """A group of row `index` scored `scores` (unscorable completions left out)."""
        if not scores:
            return
        high, low = high_low(scores)
        old_high, old_low = self.counts.get(index, (0.0, 0.0))
        self.counts[index] = (DECAY * old_high + high, DECAY * old_low + low)

    def state(self) -> dict[str, list[float]]:
        return {str(i): [round(h, 6), round(lo, 6)] for i, (h, lo) in sorted(self.counts.items())}

    def describe(self) -> dict[str, float | int]:
        """For `ctl status`: rows visited and their mean weight."""
        if not self.counts:
            return {"rows_seen": 0}
        weights = [self.weight(i) for i in self.counts]
        return {"rows_seen": len(self.counts), "mean_weight": round(sum(weights) / len(weights), 3)}
