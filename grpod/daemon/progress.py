"""`RunProgress`: where a run is — its phase, its step counters and its last results.

One object, handed to the step loop (which advances it), the supervisor (which sets the phase and
the outcome) and the reporting (which reads it for `ctl status`, the progress line, the summary
and Prometheus). Nothing else holds a copy of these values.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any


class RunPhase(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    DRAINING = "draining"
    STOPPING = "stopping"
    STOPPED = "stopped"


@dataclass
class RunProgress:
    steps: int  # train.steps: the batches this run is to consume
    phase: RunPhase = RunPhase.STARTING
    step: int = 0  # batches consumed (train.steps counts these)
    trained_steps: int = 0  # batches that took an optimizer update
    skipped_batches: int = 0  # batches that trained nothing (all rejected, zero-variance, non-finite)
    exit_code: int = 0
    stop_reason: str | None = None
    last_metrics: dict[str, Any] = field(default_factory=dict)
    last_eval: dict[str, Any] = field(default_factory=dict)
    last_checkpoint: dict[str, Any] | None = None
    started_at: float = field(default_factory=time.time)
    # Seconds each start-up phase took (`ctl status` "startup", the `startup` log event).
    startup: dict[str, float] = field(default_factory=dict)
    # Training time of this process: from the first step's start; steps and tokens since then.
    training_since: float | None = None
    steps_this_run: int = 0
    tokens_this_run: float = 0.0
    generated_tokens_this_run: float = 0.0

    def begin_training(self) -> None:
        """The step loop starts: the rates count from here."""
        if self.training_since is None:
            self.training_since = time.monotonic()

    def count_batch(self, trained: bool, metrics: dict[str, Any]) -> None:
        self.begin_training()
        self.step += 1
        self.steps_this_run += 1
        if trained:
            self.trained_steps += 1
        else:
            self.skipped_batches += 1
        self.tokens_this_run += float(metrics.get("tokens") or 0.0)
        self.generated_tokens_this_run += float(metrics.get("completion_tokens") or 0.0)

    def fail(self, reason: str) -> None:
        self.exit_code = 1
        self.stop_reason = reason

    def rates(self) -> dict[str, float | None]:
        """Steps/s and tokens/s over this process's training time (None before the first step)."""
        if self.training_since is None:
            return {"steps_per_s": None, "tokens_per_s": None, "generated_tokens_per_s": None}
        seconds = max(time.monotonic() - self.training_since, 1e-6)
        return {
            "steps_per_s": self.steps_this_run / seconds,
            "tokens_per_s": self.tokens_this_run / seconds,
            "generated_tokens_per_s": self.generated_tokens_this_run / seconds,
        }

    def restore_counts(self, step: int, extra: dict[str, Any]) -> None:
        """From a checkpoint: the step reached and the trained/skipped split."""
        counts = extra.get("step_counts", {})
        self.step = step
        self.trained_steps = int(counts.get("trained", step))
        self.skipped_batches = int(counts.get("skipped", 0))
