"""The replay source: the groups an earlier run consumed (`run.record_rollouts`), in order.

It makes a run reproducible: the same groups reach the trainer in the same order, so two runs
(or one run killed and resumed) can be compared parameter for parameter. The cursor is the next
line of the file; when the file is exhausted the source stops producing and the run ends once
the buffer is drained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from grpod.config import ReplaySourceConfig
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.source import MayGenerate, SourceStats


class ReplayError(Exception):
    pass


@dataclass
class ReplayStats(SourceStats):
    replayed: int = 0


def record_groups(path: Path, step: int, groups: list[RolloutGroup]) -> None:
    with open(path, "a") as f:
        for group in groups:
            f.write(json.dumps({"step": step, "group": group.to_json()}) + "\n")


class ReplaySource:
    kind = "replay"
    fill_cancel_safe = True  # the cursor advances only once the buffer holds the group
    may_resend = True  # the record of a run that took them from Atropos: admitted as that run admitted them

    def __init__(self, src: ReplaySourceConfig, *, cursor: dict | None = None) -> None:
        path = src.replay_path
        assert path is not None
        self.path = Path(path)
        if not self.path.is_file():
            raise ReplayError(f"source.replay_path {self.path}: no such file")
        self.next_line = int((cursor or {}).get("next_line", 0))
        self.stats = ReplayStats()
        self._lines = self.path.read_text().splitlines()

    def cursor(self) -> dict:
        return {"kind": self.kind, "next_line": self.next_line}

    def _peek(self) -> RolloutGroup | None:
        if self.next_line >= len(self._lines):
            self.stats.exhausted = True
            return None
        number = self.next_line + 1
        try:
            record = json.loads(self._lines[self.next_line])
            return RolloutGroup.from_json(record["group"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ReplayError(f"{self.path}:{number}: not a recorded group ({exc})") from None

    async def _put_next(self, buffer: RolloutBuffer) -> bool:
        """Move the next group into the buffer. The cursor advances only once the buffer holds
        it, so a checkpoint taken while `put` waits records the group as not yet read."""
        group = self._peek()
        if group is None:
            return False
        await buffer.put(group)
        self.next_line += 1
        self.stats.replayed += 1
        return True

    async def fill(self, buffer: RolloutBuffer, count: int) -> None:
        for _ in range(count):
            if not await self._put_next(buffer):
                return

    async def evaluate(self, size: int, max_tokens: int) -> None:
        """A replay has no held-out data."""
        return None

    async def run(self, buffer: RolloutBuffer, may_generate: MayGenerate) -> None:
        """Put every remaining group into the buffer; returns when the file is exhausted."""
        while True:
            await may_generate()
            if not await self._put_next(buffer):
                return
