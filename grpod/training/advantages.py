"""Group-relative advantages: one number per completion, from the scores of its group.

For a group with scores `r_1..r_k` (mean `m`, population std `s`) the advantage of completion `i` is

    scale = "group":  A_i = (r_i - m) / (s + eps)           GRPO
    scale = "batch":  A_i = (r_i - m) / (S + eps)           S = std of every kept (r_j - m_g) in the step
    scale = "none":   A_i =  r_i - m                        Dr. GRPO (mean-centred, no std division)

then multiplied by the group's `weight` (the staleness policy's down-weighting, 1.0 by default).
Centring is always within the group: what a completion is compared with is its siblings. "batch"
divides by one spread for the whole step, so a group whose scores barely differ does not get its
noise blown up to unit scale as "group" does.

A group whose scores are all equal (a zero-variance group) carries no learning signal; with
`drop_zero_variance` it is left out of the step entirely (its tokens are not trained on and not
counted in the loss normalisers) and counted in `AdvantageResult.dropped_zero_variance`.

With `use_source_advantages`, a group that arrives with advantages (Atropos environments may send
them) uses those as they are instead (times `weight`); such a group counts as zero-variance when
all of them are zero. Groups without them fall back to the scores.

A per-sequence override `{"set_advantage_to_zero": true}` zeroes that completion's advantage after
the group statistics are computed: it still shapes its siblings' baseline but gets no gradient push.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from grpod.config import AdvantageConfig
from grpod.rollouts.group import RolloutGroup

EPS = 1e-6
# Scores closer than this count as equal (reward functions return exact values; this absorbs
# float noise from averaged or weighted rewards).
ZERO_VARIANCE_TOL = 1e-9


@dataclass
class AdvantageResult:
    """The groups kept for training, each with one advantage per sequence (same order)."""

    groups: list[RolloutGroup] = field(default_factory=list)
    advantages: list[list[float]] = field(default_factory=list)
    dropped_zero_variance: int = 0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _population_std(values: list[float]) -> float:
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def _source_advantages(group: RolloutGroup, cfg: AdvantageConfig) -> list[float] | None:
    if cfg.use_source_advantages and group.advantages is not None:
        return [float(a) for a in group.advantages]
    return None


def _is_zero_variance(group: RolloutGroup, cfg: AdvantageConfig) -> bool:
    source = _source_advantages(group, cfg)
    if source is not None:
        return all(a == 0.0 for a in source)
    return max(group.scores) - min(group.scores) <= ZERO_VARIANCE_TOL


def _overridden_to_zero(group: RolloutGroup, i: int) -> bool:
    if not group.overrides or i >= len(group.overrides):
        return False
    return bool((group.overrides[i] or {}).get("set_advantage_to_zero"))


def compute_advantages(groups: list[RolloutGroup], cfg: AdvantageConfig) -> AdvantageResult:
    """Advantages for every kept group; see the module docstring for the formulas."""
    result = AdvantageResult()
    for group in groups:
        if cfg.drop_zero_variance and _is_zero_variance(group, cfg):
            result.dropped_zero_variance += 1
            continue
        result.groups.append(group)

    centred: list[list[float] | None] = []
    for group in result.groups:
        if _source_advantages(group, cfg) is not None:
            centred.append(None)
        else:
            m = _mean(group.scores)
            centred.append([float(r) - m for r in group.scores])

    batch_values = [a for values in centred if values is not None for a in values]
    batch_std = _population_std(batch_values) if batch_values else 0.0

    for group, values in zip(result.groups, centred, strict=True):
        if values is None:
            advantages = _source_advantages(group, cfg)
        elif cfg.scale == "group":
            std = _population_std(group.scores)
            advantages = [a / (std + EPS) for a in values]
        elif cfg.scale == "batch":
            advantages = [a / (batch_std + EPS) for a in values]
        else:
            advantages = values
        advantages = [
            0.0 if _overridden_to_zero(group, i) else a * group.weight for i, a in enumerate(advantages)
        ]
        result.advantages.append(advantages)
    return result
