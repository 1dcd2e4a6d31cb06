"""`RolloutSource`: what the daemon asks of every source of scored groups (`make_source` in
`grpod.rollouts.kinds` builds one from the config).

A source fills the rollout buffer (`run`, concurrently with training; `fill`, the synchronous
loop's path), says where it is (`cursor`, checkpointed so a resumed run continues the stream), how
it is doing (`stats`, one shape: `SourceStats`), and may evaluate the policy on held-out data
(`evaluate`; None where it has none). Sources see the policy through the `Policy` handle only.

Every group a source gives up on (a failed request, a reward function that raised) is counted in
`stats.drop_reasons`; every group it refuses as malformed goes into the daemon's one
`RejectionCounter`, which validation shares.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from grpod.rollouts.buffer import RolloutBuffer

MayGenerate = Callable[[], Awaitable[None]]


@dataclass
class SourceStats:
    """What every source reports (`ctl status` shows `vars(stats)`; kinds add their own fields).

    The failure run — wall time of the first failure of the current unbroken run of failures, its
    length and the last error — is what the daemon's source alarm reads
    (`grpod.daemon.alarms.SourceErrorAlarm`); a success ends the run."""

    dropped: int = 0
    drop_reasons: dict[str, int] = field(default_factory=dict)
    failing_since: float | None = None
    consecutive_errors: int = 0
    last_error: str | None = None
    # A finite source (replay, a dataset with `epochs`) that has nothing more to give.
    exhausted: bool = False

    def step_metrics(self) -> dict[str, Any]:
        """What the source adds to every step record (`metrics.jsonl`); kinds add their own. Since
        this process started: the groups the source dropped, and how many for each reason
        (`source_drops/<reason>`: environment_crash, reward_timeout, ...)."""
        return {"source_dropped": self.dropped, **{f"source_drops/{reason}": n for reason, n in self.drop_reasons.items()}}

    def drop(self, reason: str) -> None:
        self.dropped += 1
        self.drop_reasons[reason] = self.drop_reasons.get(reason, 0) + 1

    def failing(self, error: str) -> None:
        """One failure, part of the current run of failures."""
        self.last_error = error[:300]
        self.consecutive_errors += 1
        if self.failing_since is None:
            self.failing_since = time.time()

    def failed(self, reason: str, error: str) -> None:
        """A group lost to a failure: dropped, and part of the current run of failures."""
        self.drop(reason)
        self.failing(error)

    def succeeded(self) -> None:
        self.failing_since = None
        self.consecutive_errors = 0


class RolloutSource(Protocol):
    kind: str
    stats: SourceStats
    # Whether `fill` may be cancelled at any await and lose nothing (what it took is in the buffer
    # or in the cursor): the loop then cancels a waiting fill to serve the operator, otherwise
    # only for a stop.
    fill_cancel_safe: bool
    # Whether it may hand over the same group twice (Atropos' run-api, a replayed record): its
    # groups then pass the duplicate window (`grpod.rollouts.duplicates`); a source that samples
    # its own groups never repeats one, however alike two of them are.
    may_resend: bool

    def cursor(self) -> dict[str, Any]:
        """Where the source is, for the checkpoint (`make_source(..., cursor=)` continues there):
        a snapshot in containers of its own, since the checkpoint is written in a worker thread
        while the source draws on."""

    async def run(self, buffer: RolloutBuffer, may_generate: MayGenerate) -> None:
        """Keep `buffer` topped up (awaiting `may_generate` before each request); returns only
        once a finite source is exhausted."""

    async def fill(self, buffer: RolloutBuffer, count: int) -> None:
        """Put `count` groups into `buffer` (the synchronous loop's path)."""

    async def evaluate(self, size: int, max_tokens: int) -> dict[str, Any] | None:
        """Held-out metrics of the policy served now (`eval_accuracy`, `eval_size`, ...), or None
        when the source has no held-out data."""
