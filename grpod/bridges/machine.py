"""The state-machine core every bridge mode is built on.

A bridge mode is data: an enum of states, an enum of events, and one transition table mapping
(state, event) to the next state. `StateMachine.fire` is the only way a state changes; it refuses
a transition the table does not list (a bug, never silently ignored) and logs every transition as
one structlog event with the time spent in the state being left.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger(__name__)


class IllegalTransition(RuntimeError):
    """An event arrived in a state whose table has no entry for it."""


@dataclass
class Transition:
    source: str
    target: str
    event: str
    elapsed_s: float
    at: float


@dataclass
class StateMachine:
    name: str
    table: Mapping[tuple[enum.Enum, enum.Enum], enum.Enum]
    state: enum.Enum
    history: list[Transition] = field(default_factory=list)
    _entered: float = field(default_factory=time.monotonic)
    error: str | None = None

    def can_fire(self, event: enum.Enum) -> bool:
        return (self.state, event) in self.table

    def fire(self, event: enum.Enum, *, error: str | None = None) -> enum.Enum:
        key = (self.state, event)
        if key not in self.table:
            raise IllegalTransition(
                f"bridge {self.name}: event {event.name} is not allowed in state {self.state.name}"
            )
        now = time.monotonic()
        target = self.table[key]
        record = Transition(self.state.name, target.name, event.name, now - self._entered, time.time())
        self.history.append(record)
        del self.history[:-50]
        log.info(
            "bridge_transition",
            bridge=self.name,
            source=record.source,
            target=record.target,
            trigger=record.event,
            elapsed_s=round(record.elapsed_s, 4),
            error=error,
        )
        self.state, self._entered = target, now
        self.error = error
        return target

    def seconds_in_state(self) -> float:
        return time.monotonic() - self._entered

    def table_rows(self) -> list[tuple[str, str, str]]:
        return [(s.name, e.name, t.name) for (s, e), t in self.table.items()]

    def describe(self) -> dict:
        return {
            "state": self.state.name,
            "seconds_in_state": round(self.seconds_in_state(), 3),
            "error": self.error,
            "transitions": [f"{s} --{e}--> {t}" for s, e, t in self.table_rows()],
            "recent": [
                {"from": t.source, "to": t.target, "event": t.event, "elapsed_s": round(t.elapsed_s, 4)}
                for t in self.history[-5:]
            ],
        }


def render_table(table: Mapping[tuple[enum.Enum, enum.Enum], enum.Enum]) -> str:
    """The transition table as aligned text, for module docstrings and `ctl status`."""
    rows = [(s.name, e.name, t.name) for (s, e), t in table.items()]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return "\n".join(f"{a:<{w0}}  --{b:<{w1}}-->  {c}" for a, b, c in rows)


def docstring_table(table: Mapping[tuple[enum.Enum, enum.Enum], enum.Enum], notes: Mapping[tuple[str, str], str]) -> str:
    """The transition table as a mode's module docstring prints it, made from the table itself (a
    mode module appends it to its docstring, so the rows are written once): one row per
    transition in state order, a note where `notes[(state, event)]` gives one, and FAIL and STOP,
    which every live state has, folded into the two `any` rows."""
    states = list(type(next(iter(table.values()))))
    events = list(type(next(iter(table))[1]))
    rows = []
    for (source, event), target in sorted(table.items(), key=lambda r: (states.index(r[0][0]), events.index(r[0][1]))):
        if event.name in ("FAIL", "STOP", "STOPPED"):
            continue
        note = notes.get((source.name, event.name))
        arrow = f"    {source.name:<11} --{event.name:-<11}>  {target.name}"
        rows.append(f"{arrow:<46}({note})" if note else arrow)
    rows += ["    any         --FAIL------->  FAILED", "    any         --STOP------->  STOPPING --STOPPED--> STOPPED"]
    return "\n".join(rows) + "\n"
