"""What a group's scores say before any advantage is computed: overlong shaping and signal.

Shared by the trainer's advantages (`grpod.training.advantages`) and by the sources' dynamic
sampling, so the two never disagree about which groups carry a learning signal.
"""

from __future__ import annotations

import math

from grpod.config import AdvantageConfig
from grpod.rollouts.group import RolloutGroup

# Scores closer than this, relative to their magnitude (at least 1), count as equal (reward
# functions return exact values; this absorbs float noise from averaged or weighted rewards, which
# grows with the scores: at 1e8 one float step is 1.5e-8).
ZERO_VARIANCE_TOL = 1e-9


def magnitude(values: list[float]) -> float:
    """The largest magnitude (1.0 for all zeros): sums and squares are taken of `values` divided by
    it, so that finite scores near float's range (a tool bonus of 1e308, say) neither overflow to
    inf nor square to inf (or raise: `x ** 2` does), which made every advantage NaN or 0."""
    return max(map(abs, values), default=0.0) or 1.0


def mean_of(values: list[float]) -> float:
    scale = magnitude(values)
    return scale * (sum(v / scale for v in values) / len(values))


def spread(values: list[float], kind: str) -> float:
    """The sample (n - 1) or population std; 0 for fewer than two sample values."""
    m = mean_of(values)
    deviations = [v - m for v in values]
    scale = magnitude(deviations)
    squares = sum((d / scale) ** 2 for d in deviations)
    if kind == "sample":
        return scale * math.sqrt(squares / (len(values) - 1)) if len(values) > 1 else 0.0
    return scale * math.sqrt(squares / len(values))


def standardized(values: list[float], kind: str, eps: float) -> list[float]:
    """(v - mean) / (std + eps) of each value (`kind`: "sample" or "population" std), taken in
    units of their largest magnitude: the same floats for values within [-1, 1], and no overflow
    for finite values near float's range (their deviation, its square)."""
    scale = magnitude(values)
    scaled = [v / scale for v in values]
    centre, std = mean_of(scaled), spread(scaled, kind)
    return [(v - centre) / (std + eps / scale) for v in scaled]


def overlong_penalty(completion_tokens: int, budget: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (<= 0) for a completion of `completion_tokens` tokens."""
    if buffer <= 0 or completion_tokens <= budget - buffer:
        return 0.0
    return -penalty * min(1.0, (completion_tokens - (budget - buffer)) / buffer)


def shaped_scores(group: RolloutGroup, cfg: AdvantageConfig, budget: int) -> list[float]:
    """The group's scores after overlong shaping (the scores themselves when it is off)."""
    scores = [float(r) for r in group.scores]
    if cfg.overlong_buffer <= 0:
        return scores
    return [
        r + overlong_penalty(sum(mask), budget, cfg.overlong_buffer, cfg.overlong_penalty)
        for r, mask in zip(scores, group.loss_mask, strict=True)
    ]


def source_advantages(group: RolloutGroup, cfg: AdvantageConfig) -> list[float] | None:
    if cfg.use_source_advantages and group.advantages is not None:
        return [float(a) for a in group.advantages]
    return None


def has_override(group: RolloutGroup, i: int, key: str) -> bool:
    """Whether completion `i` of `group` carries the per-sequence override `key`."""
    if not group.overrides or i >= len(group.overrides):
        return False
    return bool((group.overrides[i] or {}).get(key))


def scored_indices(group: RolloutGroup) -> list[int]:
    """The completions that have a score: not marked `unscorable` (every reward function of the
    dataset source answered None, TRL's semantics): those are left out of every statistic."""
    return [i for i in range(len(group.scores)) if not has_override(group, i, "unscorable")]


def all_equal(values: list[float]) -> bool:
    """Whether `values` (none counts) are equal within ZERO_VARIANCE_TOL of their magnitude:
    centred on their own mean, they give no advantage (only float noise, which normalising by the
    group's spread would blow up to whole advantages)."""
    if not values:
        return True
    low, high = min(values), max(values)
    return high - low <= ZERO_VARIANCE_TOL * max(1.0, abs(low), abs(high))


def is_zero_variance(group: RolloutGroup, scores: list[float], cfg: AdvantageConfig) -> bool:
    """Whether the group gives no advantage. Per estimator: `grpo` and `rloo` compare a completion
    with its siblings, so equal scores carry nothing; `reinforce_pp` compares it with the whole
    batch, so an all-correct group still carries signal (its advantage is r - batch mean) and is
    never zero-variance by itself (a step whose every score is equal is: `grpod.training.advantages`
    drops it whole)."""
    source = source_advantages(group, cfg)
    if source is not None:
        return all(a == 0.0 for a in source)
    if cfg.estimator == "reinforce_pp":
        return False
    return all_equal([scores[i] for i in scored_indices(group)])


def carries_signal(group: RolloutGroup, cfg: AdvantageConfig, completion_budget: int) -> bool:
    """False for a zero-variance group, the kind `drop_zero_variance` leaves out of a step (what
    dynamic sampling filters before a group is queued)."""
    return not is_zero_variance(group, shaped_scores(group, cfg, completion_budget), cfg)
