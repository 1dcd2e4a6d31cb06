"""The sync schedule as a table: a state (steps unsynced, a sync owed) and an event give a decision
and the next state. The cadence is every 2nd step (`bridge.sync_every = 2`); the step loop's own
tests (`test_step_loop.py`) check that it carries the decisions out."""

from __future__ import annotations

import pytest

from grpod.daemon.sync_schedule import Sync, SyncSchedule


# before (unsynced, owed) | event | decision | after (unsynced, owed) | why. Events: `step N` and
# what else held (`skipped`, `fenced`, `requested`: an operator's sync during the step, `held`:
# an evaluation runs beside training), `boundary` (an operator's sync there), `evaluation ended`,
# `evaluation due` (one is about to start).
TABLE = """
0 no  | step 2                     | STEP   | 0 no  | the step itself trained: its sync
0 no  | step 1                     | NONE   | 1 no  | trained off the cadence: one step unsynced
1 no  | step 2                     | STEP   | 0 no  | trained on the cadence: the step's sync
1 no  | step 2 skipped             | STEP   | 0 no  | skipped on the cadence: ships the steps before it
0 no  | step 2 skipped             | NONE   | 0 no  | skipped on the cadence, nothing trained since
0 no  | step 3 skipped             | NONE   | 0 no  | skipped off the cadence
1 no  | step 2 held                | HOLD   | 2 yes | due while an evaluation runs: held, owed
1 no  | step 3 held                | NONE   | 2 no  | off the cadence while an evaluation runs: nothing due
2 yes | step 3 held                | HOLD   | 3 yes | owed, the evaluation still on: held
2 yes | step 3 skipped held        | HOLD   | 2 yes | owed, skipped, the evaluation still on
2 yes | step 3                     | STEP   | 0 no  | owed, the evaluation over: paid off the cadence
2 yes | step 3 skipped             | STEP   | 0 no  | owed, skipped, the evaluation over: paid
0 no  | step 1 fenced              | NONE   | 0 no  | fenced (shared): the fence made the sync
3 no  | step 2 fenced              | NONE   | 0 no  | fenced on the cadence: nothing left to ship
0 no  | step 1 requested           | FORCED | 0 no  | ctl sync during a step: the step's sync
1 no  | step 2 requested           | FORCED | 0 no  | ctl sync on the cadence: one sync, forced
1 yes | step 3 requested held      | FORCED | 0 no  | ctl sync while held: forced, pays the owed
0 no  | step 1 fenced requested    | FORCED | 0 no  | ctl sync in shared: a re-fence
0 no  | boundary                   | FORCED | 0 no  | ctl sync at the boundary, nothing new: still a sync
2 yes | boundary                   | FORCED | 0 no  | ctl sync at the boundary pays the owed sync
2 yes | evaluation ended           | OWED   | 0 no  | the evaluation ended: the owed sync, now
1 no  | evaluation ended           | NONE   | 1 no  | the evaluation ended, nothing owed
1 no  | evaluation due             | EVAL   | 0 no  | an evaluation measures the trainer's step, not the last synced one
2 yes | evaluation due             | OWED   | 0 no  | an evaluation due pays the owed sync
0 no  | evaluation due             | NONE   | 0 no  | an evaluation due, the engines in step: nothing to ship
"""


def state(text: str) -> tuple[int, bool]:
    unsynced, owed = text.split()
    return int(unsynced), owed == "yes"


def happen(event: str, schedule: SyncSchedule) -> Sync:
    """Apply one event of the table to `schedule`; its decision."""
    if event == "boundary":
        return schedule.requested()
    if event == "evaluation ended":
        return schedule.evaluation_ended()
    if event == "evaluation due":
        return schedule.evaluation_due()
    _, step, *flags = event.split()
    assert set(flags) <= {"skipped", "fenced", "requested", "held"}, event
    return schedule.after_step(
        int(step), trained="skipped" not in flags, fenced="fenced" in flags, requested="requested" in flags,
        held="held" in flags,
    )


ROWS = [[cell.strip() for cell in line.split("|")] for line in TABLE.strip().splitlines()]


@pytest.mark.parametrize(("before", "event", "decision", "after", "why"), ROWS, ids=[row[4] for row in ROWS])
def test_a_state_and_an_event_give_the_decision_and_the_next_state(before, event, decision, after, why):
    unsynced, owed = state(before)
    schedule = SyncSchedule(cadence=lambda step: step % 2 == 0, unsynced=unsynced, owed=owed)
    assert happen(event, schedule) is Sync[decision]
    assert (schedule.unsynced, schedule.owed) == state(after)


def test_only_step_owed_eval_and_forced_ship_a_sync():
    assert [d for d in Sync if d.ships] == [Sync.STEP, Sync.OWED, Sync.EVAL, Sync.FORCED]


def test_the_cadence_is_read_at_each_step():
    """A live `bridge.sync_every` change takes effect at the next step."""
    every = {"n": 4}
    schedule = SyncSchedule(cadence=lambda step: step % every["n"] == 0)
    assert happen("step 2", schedule) is Sync.NONE
    every["n"] = 1
    assert happen("step 3", schedule) is Sync.STEP
