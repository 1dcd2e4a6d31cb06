"""`BatchAdmission`: which groups of a batch may reach the loss — validate, deduplicate, staleness.

Each step's batch passes three gates, in this order:
1. validation (`grpod.rollouts.validation`): malformed groups are rejected with a reason;
2. the duplicate window (`grpod.rollouts.duplicates`): a group seen before is rejected
   (`duplicate`);
3. the staleness bound (`grpod.rollouts.staleness`): groups more than `train.max_staleness`
   policy versions behind the policy are dropped or down-weighted (`train.stale_policy`).

Every rejection is counted in the run's one `RejectionCounter` and logged once. Groups without
inference logprobs (an Atropos environment that sends none) are admitted and train with IS
weight 1, counted as `is_uncorrected_tokens` (see `grpod.training.loss`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from grpod.config import TrainConfig
from grpod.rollouts.duplicates import DuplicateWindow
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.staleness import StalenessStats, apply_staleness
from grpod.rollouts.validation import RejectionCounter, record_rejection, validate_batch


@dataclass
class Admitted:
    groups: list[RolloutGroup]  # what may train (weights set by the staleness policy)
    rejected: int  # malformed or duplicate
    ages: list[int] = field(default_factory=list)  # staleness of each group that passed validation

    @property
    def staleness_mean(self) -> float:
        return sum(self.ages) / len(self.ages) if self.ages else 0.0

    @property
    def staleness_max(self) -> int:
        return max(self.ages) if self.ages else 0


class BatchAdmission:
    def __init__(self, train: TrainConfig, *, vocab_size: int, max_seq_len: int, rejections: RejectionCounter,
                 may_resend: bool = True) -> None:
        """`train` is the live `train` section (max_staleness may change while running);
        `may_resend`: the source's (a window of duplicates only for a source that may resend)."""
        self.train = train
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.rejections = rejections
        self.duplicates = DuplicateWindow() if may_resend else None
        self.staleness = StalenessStats()

    def admit(self, groups: list[RolloutGroup], policy_version: int) -> Admitted:
        advantages = self.train.advantages
        valid, rejected = validate_batch(
            groups,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            group_normalised=advantages.scale != "none" or advantages.drop_zero_variance,
            require_logprobs=False,
            counter=self.rejections,
        )
        fresh = []
        for group in valid:
            duplicate = self.duplicates.admit(group) if self.duplicates is not None else None
            if duplicate is None:
                fresh.append(group)
            else:
                record_rejection(group, duplicate, self.rejections)
                rejected.append((group, duplicate))
        trainable, ages = apply_staleness(
            fresh, policy_version, self.train.max_staleness, self.train.stale_policy, self.staleness
        )
        return Admitted(trainable, len(rejected), ages)
