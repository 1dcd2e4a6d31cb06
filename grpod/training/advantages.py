"""Advantages: one number per completion, from the scores of its group (or of the whole step).

Scores first go through optional overlong shaping (DAPO's soft punishment): with a completion
budget M (`GrpodConfig.completion_budget`) and a buffer B = `overlong_buffer`, a completion of
L loss tokens loses `overlong_penalty` x min(1, (L - (M - B)) / B) when L > M - B.

`estimator` then turns the scores `r_1..r_k` of a group (mean `m`, std `s`, `std` = "sample"
(n - 1, the peers' default) or "population") into advantages:

    grpo, scale = "group":   A_i = (r_i - m) / (s + eps)              GRPO
    grpo, scale = "batch":   A_i = (r_i - m) / (S + eps)              S = std of every kept (r_j - m_g) in the step
    grpo, scale = "none":    A_i =  r_i - m                           Dr. GRPO (mean-centred, no std division)
    rloo:                    A_i =  r_i - mean_{j != i} r_j = k / (k - 1) (r_i - m)    leave-one-out
    reinforce_pp:            A_i = (r_i - M) / (S' + eps)             REINFORCE++: M, S' over all kept scores

then multiplied by the group's `weight` (the staleness policy's down-weighting, 1.0 by default).
GRPO's centring is within the group: what a completion is compared with is its siblings. "batch"
divides by one spread for the whole step, so a group whose scores barely differ does not get its
noise blown up to unit scale as "group" does.

A group whose (shaped) scores are all equal (a zero-variance group: equal within a tolerance
relative to their magnitude, `grpod.rollouts.signal.all_equal`) carries no learning signal among
its siblings; with `drop_zero_variance` it is left out of the step entirely (its tokens are not
trained on and not counted in the loss normalisers) and counted in
`AdvantageResult.dropped_zero_variance`; without it, it is kept with advantage 0 (not the float
noise between its scores, which "group" would divide up to unit scale).

With `use_source_advantages`, a group that arrives with advantages (Atropos environments may send
them) uses those as they are instead (times `weight`); such a group counts as zero-variance when
all of them are zero. Groups without them fall back to the scores.

A per-sequence override `{"set_advantage_to_zero": true}` zeroes that completion's advantage after
the group statistics are computed: it still shapes its siblings' baseline but gets no gradient push.
`{"unscorable": true}` (every reward function answered None) leaves the completion out of every
statistic (group mean and std, batch and pooled spreads, zero variance) and gives it advantage 0,
as TRL does with its NaN rewards.

Zero variance is estimator-aware (`grpod.rollouts.signal.is_zero_variance`): under `reinforce_pp`
the baseline is the batch's, so no group is dropped for equal scores of its own. But when every
scored completion of the step scored the same (every group failed, say), the step's baseline is
that score and every advantage is zero: with `drop_zero_variance` those groups are dropped, so the
trainer skips the step as it does a step of flat groups under `grpo`, instead of a forward and
backward pass for no gradient and an optimizer step driven by its moments alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grpod.config import AdvantageConfig
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.signal import (
    all_equal,
    has_override,
    is_zero_variance,
    mean_of,
    scored_indices,
    shaped_scores,
    source_advantages,
    spread,
    standardized,
)

EPS = 1e-6


@dataclass
class AdvantageResult:
    """The groups kept for training, each with one advantage per sequence (same order)."""

    groups: list[RolloutGroup] = field(default_factory=list)
    advantages: list[list[float]] = field(default_factory=list)
    dropped_zero_variance: int = 0
    overlong_penalized: int = 0


def _from_scores(scores: list[float], cfg: AdvantageConfig, batch: tuple[float, float], pooled_std: float) -> list[float]:
    m = mean_of(scores)
    if cfg.estimator == "rloo":
        k = len(scores)
        return [k / (k - 1) * (r - m) if k > 1 else 0.0 for r in scores]
    if cfg.estimator == "reinforce_pp":
        batch_mean, batch_std = batch
        return [(r - batch_mean) / (batch_std + EPS) for r in scores]
    if cfg.scale == "group":
        # In units of the scores' largest magnitude: a deviation of scores at both ends of float's
        # range (1.7e308 and -1.7e308) overflows, its ratio to the std does not.
        return standardized(scores, cfg.std, EPS)
    if cfg.scale == "batch":
        return [(r - m) / (pooled_std + EPS) for r in scores]
    return [r - m for r in scores]


def _flat_step(groups: list[RolloutGroup], shaped: list[list[float]], sourced: list[bool], cfg: AdvantageConfig) -> bool:
    """Under the step-wide baseline (`reinforce_pp`): whether every completion scored from scores
    (`sourced` False: no source advantages) scored the same, so that none of them gets an advantage."""
    return cfg.estimator == "reinforce_pp" and all_equal(
        [scores[i] for g, scores, s in zip(groups, shaped, sourced) if not s for i in scored_indices(g)]
    )


def compute_advantages(groups: list[RolloutGroup], cfg: AdvantageConfig, completion_budget: int = 0) -> AdvantageResult:
    """Advantages for every kept group; see the module docstring for the formulas."""
    result = AdvantageResult()
    kept_scores: list[list[float]] = []
    kept_flat: list[bool] = []  # kept without a signal (drop_zero_variance off): advantage 0, not noise
    shaped = [shaped_scores(group, cfg, completion_budget) for group in groups]
    sourced = [source_advantages(group, cfg) is not None for group in groups]
    flat_step = _flat_step(groups, shaped, sourced, cfg)
    for group, scores, from_source in zip(groups, shaped, sourced, strict=True):
        result.overlong_penalized += sum(1 for r, raw in zip(scores, group.scores) if r != float(raw))
        no_signal = is_zero_variance(group, scores, cfg) or (flat_step and not from_source)
        if cfg.drop_zero_variance and no_signal:
            result.dropped_zero_variance += 1
            continue
        result.groups.append(group)
        kept_scores.append(scores)
        kept_flat.append(no_signal and not from_source)

    # Each kept group's scored completions (unscorable ones are in no statistic).
    scored = [[scores[i] for i in scored_indices(g)] for g, scores in zip(result.groups, kept_scores)]
    from_scores = [s for g, s in zip(result.groups, scored) if source_advantages(g, cfg) is None and s]
    every = [r for scores in from_scores for r in scores]
    residuals = [r - mean_of(scores) for scores in from_scores for r in scores]
    batch = (mean_of(every), spread(every, cfg.std)) if every else (0.0, 0.0)
    pooled_std = spread(residuals, cfg.std) if residuals else 0.0

    for group, scores, flat in zip(result.groups, kept_scores, kept_flat, strict=True):
        advantages = source_advantages(group, cfg)
        if advantages is None:
            indices = scored_indices(group)
            advantages = [0.0] * len(scores)
            if indices and not flat:
                for i, a in zip(indices, _from_scores([scores[i] for i in indices], cfg, batch, pooled_std)):
                    advantages[i] = a
        advantages = [
            0.0 if has_override(group, i, "set_advantage_to_zero") or has_override(group, i, "unscorable")
            else a * group.weight
            for i, a in enumerate(advantages)
        ]
        result.advantages.append(advantages)
    return result
