"""Table fragments every mode's transition table contains (start-up, recovery, stop, failure).

Each mode module builds its full table from these plus its own sync path, so that what differs
between modes is visible in that module and what does not is written once.
"""

from __future__ import annotations

import enum


def lifecycle_rows(S: type[enum.Enum], E: type[enum.Enum]) -> dict:
    rows = {
        (S.IDLE, E.START): S.LAUNCHING,
        (S.LAUNCHING, E.READY): S.PROBING,
        (S.PROBING, E.PROBE_OK): S.SERVING,
        (S.PROBING, E.PROBE_FAIL): S.FAILED,
        (S.SERVING, E.LOST): S.RECOVERING,
        (S.RECOVERING, E.RECOVERED): S.PROBING,
        (S.FAILED, E.SYNC): S.SAVING,
    }
    for state in S:
        if state not in (S.STOPPING, S.STOPPED, S.FAILED):
            rows[(state, E.FAIL)] = S.FAILED
        if state not in (S.STOPPING, S.STOPPED):
            rows[(state, E.STOP)] = S.STOPPING
    rows[(S.STOPPING, E.STOPPED)] = S.STOPPED
    return rows
