"""DAPO's dynamic sampling: only groups that carry a learning signal are queued for training.

A group whose (shaped) scores are all equal has zero advantage everywhere; training drops it, so a
step made of such groups shrinks or vanishes. With `source.dynamic_sampling`, the builtin source
checks each generated group before queueing it and generates another in its place: a step then
has `train.groups_per_step` groups with signal. The check is the trainer's own
(`grpod.rollouts.signal.carries_signal`), so the two never disagree.

A task the policy has saturated (every group all-correct) would make that loop generate forever:
after `source.dynamic_sampling_max_filtered` filtered groups in a row, the next one is queued
anyway and counted as `dynamic_let_through` (the trainer then drops it, as without the filter).
"""

from __future__ import annotations

import structlog

from grpod.config import AdvantageConfig
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.signal import carries_signal

log = structlog.get_logger(__name__)


class DynamicSampling:
    def __init__(self, enabled: bool, max_in_a_row: int, advantages: AdvantageConfig, budget: int) -> None:
        """`advantages` and `budget` (the completion budget) decide what carries a signal, as in
        the trainer; `enabled`/`max_in_a_row` are `source.dynamic_sampling[_max_filtered]`."""
        self.enabled = enabled
        self.max_in_a_row = max_in_a_row
        self.advantages = advantages
        self.budget = budget
        self.in_a_row = 0

    def admit(self, group: RolloutGroup, stats) -> bool:
        """Whether `group` goes to the buffer; counts what it filters on `stats`."""
        if not self.enabled or carries_signal(group, self.advantages, self.budget):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        if self.in_a_row > self.max_in_a_row:
            self.in_a_row = 0
            stats.dynamic_let_through += 1
            log.warning("dynamic_sampling_let_through", group_id=group.group_id, filtered_in_a_row=self.max_in_a_row)
            return True
        stats.dynamic_filtered += 1
        return False
