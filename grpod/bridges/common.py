"""What every mode's state machine shares: the events, and the table rows for start-up,
recovery, stop and failure.

The events are the same in every mode because the sync sequence that fires them lives once
(`grpod.bridges.base`); each mode module defines its own states and builds its full table from
these rows plus its own sync path, so what differs between modes is visible in that module.
"""

from __future__ import annotations

import enum


class Event(enum.Enum):
    START = "start"
    READY = "ready"
    PROBE_OK = "probe_ok"
    PROBE_FAIL = "probe_fail"
    PROBE_SKIP = "probe_skip"
    SYNC = "sync"
    SAVED = "saved"
    NOT_SAVED = "not_saved"
    APPLIED = "applied"
    LOST = "lost"
    RECOVERED = "recovered"
    RETRY = "retry"
    FAIL = "fail"
    STOP = "stop"
    STOPPED = "stopped"


LIFECYCLE_STATES = ("IDLE", "LAUNCHING", "PROBING", "SERVING", "SAVING", "RECOVERING", "FAILED", "STOPPING", "STOPPED")


def mode_states(sync_state: str) -> type[enum.Enum]:
    """A mode's State enum: the shared lifecycle states plus the state its sync is applied in."""
    names = [*LIFECYCLE_STATES[:5], sync_state, *LIFECYCLE_STATES[5:]]
    return enum.Enum("State", [(name, name.lower()) for name in names])


def lifecycle_rows(S: type[enum.Enum], E: type[enum.Enum], sync_state: str) -> dict:
    """The rows every mode has: start-up, recovery (between syncs and during one), stop, failure.

    A vLLM lost while a sync is applied is relaunched on the weights it served before the sync
    (`LOST` from the sync state), then the sync is applied once more (`RETRY` back to it).
    """
    applying = S[sync_state]
    rows = {
        (S.IDLE, E.START): S.LAUNCHING,
        (S.LAUNCHING, E.READY): S.PROBING,
        (S.PROBING, E.PROBE_OK): S.SERVING,
        (S.PROBING, E.PROBE_FAIL): S.FAILED,
        (S.PROBING, E.PROBE_SKIP): S.SERVING,
        (S.SERVING, E.LOST): S.RECOVERING,
        (S.RECOVERING, E.RECOVERED): S.PROBING,
        (applying, E.LOST): S.RECOVERING,
        (S.RECOVERING, E.RETRY): applying,
        (S.FAILED, E.SYNC): S.SAVING,
    }
    for state in S:
        if state not in (S.STOPPING, S.STOPPED, S.FAILED):
            rows[(state, E.FAIL)] = S.FAILED
        if state not in (S.STOPPING, S.STOPPED):
            rows[(state, E.STOP)] = S.STOPPING
    rows[(S.STOPPING, E.STOPPED)] = S.STOPPED
    return rows


def mode_table(S: type[enum.Enum], E: type[enum.Enum], sync_state: str) -> dict:
    """A mode's whole table: the lifecycle rows, and its sync path SERVING --SYNC--> SAVING
    --SAVED--> <sync_state> --APPLIED--> PROBING (what a mode does in each step is its own);
    a write that fails (disk full, read-only) goes back to SERVING, no engine touched."""
    applying = S[sync_state]
    return {
        **lifecycle_rows(S, E, sync_state),
        (S.SERVING, E.SYNC): S.SAVING,
        (S.SAVING, E.SAVED): applying,
        (S.SAVING, E.NOT_SAVED): S.SERVING,
        (applying, E.APPLIED): S.PROBING,
    }


def lifecycle_notes(sync_state: str) -> dict[tuple[str, str], str]:
    """What the lifecycle rows do, as every mode's docstring table notes them."""
    return {
        ("PROBING", "PROBE_SKIP"): "bridge.probe_every: this sync is not probed",
        (sync_state, "LOST"): "vLLM died mid-sync: relaunch on the previous weights",
        ("RECOVERING", "RETRY"): "apply the same sync once more",
        ("FAILED", "SYNC"): "an operator's `ctl sync` retries",
        ("SAVING", "NOT_SAVED"): "the write failed (disk): engines untouched, the next sync retries",
    }

