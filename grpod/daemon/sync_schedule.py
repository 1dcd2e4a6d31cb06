"""`SyncSchedule`: when the engines get the trainer's weights — the one place the step loop asks.

The step loop tells it what happened (a step trained, was skipped or fenced; an operator asked;
an evaluation ended) and carries out what it answers:

    NONE    nothing to ship now
    HOLD    a sync fell due, but an evaluation running beside training holds the engines'
            version to its end: the sync is owed
    STEP    the step's sync, now (the loop may pipeline it: trainer half now, engines' half
            while the next step trains)
    OWED    the sync an evaluation held back, now that it ended: whole
    EVAL    an evaluation is about to measure the engines' policy: the steps trained since the
            last sync, now, whole (it measures the trainer's weights, not older ones)
    FORCED  an operator's `ctl sync`: whole, once no evaluation runs; it ships whatever the
            trainer has (even nothing new: a version bump and a probe) and pays what is owed

What it keeps: the steps trained since the engines last got the weights (`unsynced`; a skipped
batch changes nothing itself, but the steps before it may have, so their sync is not lost) and
whether a sync is `owed`. A sync is due after a step when a step trained since the last one and
the mode's cadence says so (`cadence(step)`: every `bridge.sync_every` steps; never in `shared`,
whose every optimizer update is a sync made in the fence), or when one is owed. Every decision
that ships marks the engines in step (nothing unsynced, nothing owed): a sync that then fails
ends the run.

    state (unsynced, owed)   event                           decision   state after
    (n, -)                   step fenced (`shared`)          NONE       (0, no)
    (n, o)                   step, operator asked            FORCED     (0, no)
    (0, no)                  step skipped                    NONE       (0, no)
    (n, no)                  step trained, off the cadence   NONE       (n+1, no)
    (n, no)                  step trained, on the cadence    STEP       (0, no)
    (n, no)                  ... while an evaluation holds   HOLD       (n+1, yes)
    (n>0, yes)               any step, evaluation ended      STEP       (0, no)
    (n>0, yes)               any step, evaluation still on   HOLD       (n(+1), yes)
    (n, o)                   operator at the boundary        FORCED     (0, no)
    (n, yes)                 evaluation ended                OWED       (0, no)
    (n, no)                  evaluation ended                NONE       (n, no)
    (n>0, o)                 evaluation due                  EVAL       (0, no)
    (0, no)                  evaluation due                  NONE       (0, no)

(`tests/daemon/test_sync_schedule.py` has every row.)
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


class Sync(enum.Enum):
    NONE = "none"
    HOLD = "hold"
    STEP = "step"
    OWED = "owed"
    EVAL = "eval"
    FORCED = "forced"

    @property
    def ships(self) -> bool:
        return self in (Sync.STEP, Sync.OWED, Sync.EVAL, Sync.FORCED)


@dataclass
class SyncSchedule:
    # The mode's cadence: whether a sync falls due after this step (`Bridge.sync_due`).
    cadence: Callable[[int], bool]
    unsynced: int = 0
    owed: bool = False

    def after_step(self, step: int, *, trained: bool, fenced: bool, requested: bool, held: bool) -> Sync:
        """The decision after `step`: it `trained` (else its batch was skipped), it was `fenced`
        (every optimizer update was a sync), an operator `requested` a sync meanwhile, an
        evaluation `held` the engines' version."""
        if fenced:
            self._shipped()
        elif trained:
            self.unsynced += 1
        if requested:
            return self._ship(Sync.FORCED)
        if not self.unsynced or not (self.owed or self.cadence(step)):
            return Sync.NONE
        if held:
            self.owed = True
            return Sync.HOLD
        return self._ship(Sync.STEP)

    def requested(self) -> Sync:
        """An operator's `ctl sync` at the boundary."""
        return self._ship(Sync.FORCED)

    def evaluation_ended(self) -> Sync:
        """The running evaluation ended: the sync it held back, if any, is paid now."""
        return self._ship(Sync.OWED) if self.owed else Sync.NONE

    def evaluation_due(self) -> Sync:
        """An evaluation is about to measure the engines' policy (the running one has ended): the
        steps trained since the last sync ship now, with the sync owed if any."""
        if self.owed:
            return self._ship(Sync.OWED)
        return self._ship(Sync.EVAL) if self.unsynced else Sync.NONE

    def _ship(self, decision: Sync) -> Sync:
        self._shipped()
        return decision

    def _shipped(self) -> None:
        self.unsynced, self.owed = 0, False
