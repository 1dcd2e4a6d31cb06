"""The staleness bound: how many policy versions old a group may be when it reaches the loss.

staleness = (policy version vLLM serves now) - (oldest version that sampled one of the group's loss
tokens, `RolloutGroup.oldest_version`: an episode whose turns span a sync is as old as its oldest
model token).
Groups within `max_staleness` train at full weight. Older ones are dropped (`drop`, the default)
or kept with weight 1 / (1 + versions beyond the bound) (`downweight`), and always counted. The
histogram of staleness over everything that arrived is a metric.

Per token (`drop`): a group whose tokens name their versions (`token_versions`: episodes whose
turns, or a turn, spanned a weight update) keeps its loss tokens within the bound and has the
older ones masked out of the loss (counted in `masked_tokens`); it is dropped only when none is
left. An episode's early turns sampled long ago no longer cost its recent ones.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from grpod.rollouts.group import RolloutGroup


@dataclass
class StalenessStats:
    histogram: Counter = field(default_factory=Counter)
    dropped: int = 0
    downweighted: int = 0
    masked_tokens: int = 0

    def as_dict(self) -> dict:
        return {
            "histogram": {str(k): v for k, v in sorted(self.histogram.items())},
            "dropped": self.dropped,
            "downweighted": self.downweighted,
            "masked_tokens": self.masked_tokens,
        }


def apply_staleness(
    groups: list[RolloutGroup], current_version: int, max_staleness: int, policy: str, stats: StalenessStats
) -> tuple[list[RolloutGroup], list[int]]:
    """Returns the groups that may train (weights set) and the staleness of every input group."""
    kept: list[RolloutGroup] = []
    ages: list[int] = []
    for group in groups:
        age = max(current_version - group.oldest_version, 0)
        ages.append(age)
        stats.histogram[age] += 1
        if age <= max_staleness:
            kept.append(group)
        elif policy == "drop" and _mask_stale_tokens(group, current_version - max_staleness, stats):
            kept.append(group)
        elif policy == "drop":
            stats.dropped += 1
        else:
            group.weight = 1.0 / (1 + age - max_staleness)
            stats.downweighted += 1
            kept.append(group)
    return kept, ages


def _mask_stale_tokens(group: RolloutGroup, oldest_allowed: int, stats: StalenessStats) -> bool:
    """Mask out of `group`'s loss the tokens sampled before `oldest_allowed`; True when some loss
    token is left (the group then trains on those), False (nothing changed) when none would be."""
    if group.token_versions is None:
        return False
    masks = [
        [m if not m or v >= oldest_allowed else 0 for m, v in zip(mask, versions, strict=True)]
        for mask, versions in zip(group.loss_mask, group.token_versions, strict=True)
    ]
    if not any(map(any, masks)):
        return False
    stats.masked_tokens += sum(map(sum, group.loss_mask)) - sum(map(sum, masks))
    group.loss_mask = masks
    return True
