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
    # Completion tokens trained with a non-zero advantage since this process started (the
    # numerator of gradient_token_share; the source's sampled_tokens counts from start too).
    gradient_tokens: float = 0.0

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
        self.gradient_tokens += float(metrics.get("gradient_tokens") or 0.0)

    def gradient_token_share(self, sampled_tokens: float | None) -> float | None:
        """The share of the generated completion tokens that reached a gradient, since start."""
        return round(self.gradient_tokens / sampled_tokens, 4) if sampled_tokens else None

    def fail(self, reason: str) -> None:
        self.exit_code = 1
        self.stop_reason = reason

    def conclude(self, *, steps: int, stopped: bool, draining: bool, exhausted: bool) -> None:
        """The step loop has ended (`steps`: the run's train.steps): why (a stop's reason is already
        set by whoever asked), and a run that consumed batches but trained none fails."""
        if self.step > 0 and self.trained_steps == 0 and not stopped:
            self.fail(
                f"no step trained: all {self.skipped_batches} batches were skipped (every group rejected, "
                "zero-variance or with a non-finite gradient; `ctl status` shows the rejections)"
            )
        elif self.step >= steps:
            self.stop_reason = self.stop_reason or "steps done"
        elif draining and not stopped:
            self.stop_reason = "drained"
        elif exhausted and not stopped:
            self.stop_reason = "source exhausted"

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
