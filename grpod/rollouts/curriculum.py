"""Difficulty levels for the dataset source (`source.dataset.curriculum`): rows carry a level, and
the rows drawn come from the level the policy passes about half the time.

Why: a group teaches only when its completions score differently. A row the policy always or never
solves gives a flat group, and its generation reaches no gradient. On a fixed set the policy
pushes rows out of that band as it learns (docs/performance.md). A task with difficulty levels
(reasoning-gym's options: digits, terms) can keep the drawn rows in it.

How: each level has its own endless stream, shuffled per pass by (shuffle_seed, level, pass). Every
generated group, trained or filtered, reports the share of its completions that passed (score at
least eval.correct_threshold). After `window` groups drawn at the current level, their mean pass
rate decides: above the band's upper bound, the next harder level; below its lower bound, the next
easier one; inside, stay, and each further group slides the window on by one. A move starts a new
window. Groups drawn at another level (in flight across a move) are not counted.

The cursor holds the current level, its window and each level's stream position, so a resumed run
draws what the stopped one would have drawn next. `band` and `window` are live settings (`ctl set`,
SIGHUP): the next group recorded is judged by them, against the groups already in the window (a
smaller window keeps its latest groups).

What it buys depends on the levels: a level whose mean pass rate is in the band can still be made
of rows the policy always solves and rows it never does. On reasoning-gym chain_sum by digits it
raised the share of generation that reached a gradient from about 0.4 to 0.43-0.51
(docs/performance.md, "Difficulty levels").
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import structlog

from grpod.config import CurriculumConfig

log = structlog.get_logger(__name__)


class Curriculum:
    """The current level, its window of pass rates, and each level's stream of item indices."""

    def __init__(self, cfg: CurriculumConfig, levels: list[int], seed: int, cursor: dict | None = None) -> None:
        """`levels[i]` is item i's level; `seed` is source.dataset.shuffle_seed; `cursor` is what
        `cursor()` returned in the stopped run."""
        self.cfg = cfg
        self.seed = seed
        self.members: dict[int, list[int]] = {}
        for index, level in enumerate(levels):
            self.members.setdefault(level, []).append(index)
        self.order = sorted(self.members)
        cursor = cursor or {}
        start = cfg.start if cfg.start is not None else self.order[0]
        if start not in self.members:
            raise ValueError(f"curriculum.start = {start}: no row has that level; the levels are {self.order}")
        self.level = int(cursor.get("level", start))
        if self.level not in self.members:  # the file changed under a resumed run
            log.warning("curriculum_level_gone", level=self.level, levels=self.order)
            self.level = start
        # Per level: [pass, position in that pass].
        self.streams: dict[int, list[int]] = {int(k): [int(v[0]), int(v[1])] for k, v in cursor.get("streams", {}).items()}
        # Unbounded: `window` (and `band`) are live settings, read at each record.
        self.window: deque[float] = deque(float(x) for x in cursor.get("window", []))
        self.moves_up = int(cursor.get("moves_up", 0))
        self.moves_down = int(cursor.get("moves_down", 0))
        self.draws: dict[int, int] = {int(k): int(v) for k, v in cursor.get("draws", {}).items()}
        self._orders: dict[tuple[int, int], list[int]] = {}

    def cursor(self) -> dict:
        return {
            "level": self.level,
            "window": list(self.window),
            # Copies (a cursor is a snapshot: `RolloutSource.cursor`): the lists change as it draws.
            "streams": {str(k): list(v) for k, v in sorted(self.streams.items())},
            "moves_up": self.moves_up,
            "moves_down": self.moves_down,
            "draws": {str(k): v for k, v in sorted(self.draws.items())},
        }

    def describe(self) -> dict[str, Any]:
        """What `ctl status` shows (source.curriculum): the level, the mean pass rate of its window
        so far, the moves and the draws per level."""
        window = round(sum(self.window) / len(self.window), 4) if self.window else None
        return {"level": self.level, "levels": self.order, "window_pass_rate": window, "window_groups": len(self.window),
                "moves_up": self.moves_up, "moves_down": self.moves_down, "draws": dict(sorted(self.draws.items()))}

    def _pass_order(self, level: int, pass_: int) -> list[int]:
        key = (level, pass_)
        if key not in self._orders:
            order = list(self.members[level])
            random.Random(f"{self.seed}:{level}:{pass_}").shuffle(order)
            self._orders = {k: v for k, v in self._orders.items() if k[0] != level}  # one pass kept per level
            self._orders[key] = order
        return self._orders[key]

    def _next(self, stream: list[int]) -> int:
        """The item index at `stream` (the current level's [pass, position]), advancing it."""
        if stream[1] >= len(self.members[self.level]):
            stream[0], stream[1] = stream[0] + 1, 0
        index = self._pass_order(self.level, stream[0])[stream[1]]
        stream[1] += 1
        return index

    def draw(self) -> tuple[int, int]:
        """(item index, its level): the next row of the current level's stream."""
        index = self._next(self.streams.setdefault(self.level, [0, 0]))
        self.draws[self.level] = self.draws.get(self.level, 0) + 1
        return index, self.level

    def peek(self, count: int) -> list[int]:
        """The item indices of the next `count` draws if the level stays (nothing advanced)."""
        stream = list(self.streams.get(self.level, [0, 0]))
        return [self._next(stream) for _ in range(count)]

    def record(self, level: int, pass_rate: float) -> None:
        """A group drawn at `level` whose completions passed at `pass_rate`; moves the level when a
        full window's mean leaves the band."""
        if level != self.level:
            return
        self.window.append(pass_rate)
        while len(self.window) > self.cfg.window:
            self.window.popleft()
        if len(self.window) < self.cfg.window:
            return
        mean = sum(self.window) / len(self.window)
        low, high = self.cfg.band
        position = self.order.index(self.level)
        if mean > high and position + 1 < len(self.order):
            self._move(self.order[position + 1], mean)
            self.moves_up += 1
        elif mean < low and position > 0:
            self._move(self.order[position - 1], mean)
            self.moves_down += 1

    def _move(self, level: int, mean: float) -> None:
        log.info("curriculum_level", level=level, previous=self.level, window_pass_rate=round(mean, 4),
                 window=len(self.window))
        self.level = level
        self.window.clear()
