"""The daemon's alarms: conditions that do not stop a run by themselves but must not go unnoticed.

`CheckpointAlarm`, `SyncAlarm`: a checkpoint, or a sync's weights, could not be written (no disk
space, a read-only filesystem): the run trains on and the next one retries.

`LogprobGapAlarm`: the trainer and vLLM must compute the same logprobs; say so when they do not.

Per step, `logprob_diff_mean` is the mean over loss tokens of (trainer - vLLM) logprob of the
sampled tokens. Staleness alone moves single steps (measured on the embedded default: mean
-0.005, 90th percentile |0.018|, max |0.044| nats/token over 100 steps), so the alarm looks at the
mean over the last `WINDOW` steps. A broken sampling contract is a persistent bias: SmolLM2 sampled
with its generation_config defaults (top_k 20, repetition penalty 1.1) gave -0.175 nats/token,
an undeclared Atropos temperature -0.105. `train.logprob_gap_alarm` (default 0.05) is the bound
on |that mean|; the alarm is logged once when raised and once when cleared, shown in `ctl status`
(`alarms.logprob_gap`) and printed on the console.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from grpod.run.checkpoint import CheckpointNotWritten
from grpod.run.store import BrokenTrainerState

log = structlog.get_logger(__name__)

WINDOW = 20


class LogprobGapAlarm:
    def __init__(self, threshold: float, window: int = WINDOW) -> None:
        self.threshold = threshold
        self.recent: deque[float] = deque(maxlen=window)
        self.active = False
        self.since_step: int | None = None
        self.raised = 0

    @property
    def mean(self) -> float | None:
        return sum(self.recent) / len(self.recent) if self.recent else None

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        gap = metrics.get("logprob_diff_mean")
        if gap is None or not math.isfinite(gap):
            return
        self.recent.append(float(gap))
        mean = self.mean
        over = len(self.recent) == self.recent.maxlen and abs(mean) > self.threshold
        if over and not self.active:
            self.active, self.since_step = True, step
            self.raised += 1
            log.warning("logprob_gap_alarm", step=step, mean_gap=round(mean, 5), threshold=self.threshold)
            print(
                f"grpod: ALARM at step {step}: trainer - vLLM logprob gap {mean:+.4f} nats/token over the last "
                f"{len(self.recent)} steps (bound {self.threshold}): vLLM is not sampling what the trainer computes "
                "(sampling parameters, temperature, dtype?)",
                file=sys.stderr, flush=True,
            )
        elif not over and self.active:
            self.active, self.since_step = False, None
            log.info("logprob_gap_cleared", step=step, mean_gap=round(mean, 5))

    def describe(self) -> dict[str, Any]:
        return {
            "active": self.active,
            "mean_gap": None if self.mean is None else round(self.mean, 6),
            "window_steps": len(self.recent),
            "threshold": self.threshold,
            "since_step": self.since_step,
            "raised": self.raised,
        }


class SourceErrorAlarm:
    """A source that keeps failing (run-api answering HTTP 500 to every `/batch`, vLLM never
    generating) stops training for good while everything else looks alive. A source reports the
    current unbroken run of failures in its stats (`failing_since`, wall time of the first failure
    with no success since, and `consecutive_errors`, with `last_error`); once that run has lasted
    `source.error_alarm_s` the alarm is raised: logged, printed on the console, in `ctl status`
    (`alarms.source`), in Prometheus and in the systemd STATUS line. With `source.fail_after_s`
    set, a run of failures that long ends the run with exit status 1 (`check` returns the reason).
    """

    def __init__(self, alarm_after_s: float, fail_after_s: float | None) -> None:
        self.alarm_after_s = alarm_after_s
        self.fail_after_s = fail_after_s
        self.active = False
        self.raised = 0
        self.failing_s: float | None = None
        self.errors = 0
        self.last_error: str | None = None

    def check(self, stats: Any, now: float) -> str | None:
        """Look at a source's stats; the reason to end the run, or None."""
        since = getattr(stats, "failing_since", None)
        self.errors = int(getattr(stats, "consecutive_errors", 0) or 0)
        self.last_error = getattr(stats, "last_error", None)
        self.failing_s = None if since is None else max(now - since, 0.0)
        failing = self.failing_s is not None and self.failing_s >= self.alarm_after_s
        if failing and not self.active:
            self.active = True
            self.raised += 1
            log.warning("source_error_alarm", failing_s=round(self.failing_s, 1), errors=self.errors, last_error=self.last_error)
            print(f"grpod: ALARM: {self.summary()}", file=sys.stderr, flush=True)
        elif not failing and self.active:
            self.active = False
            log.info("source_error_cleared")
            print("grpod: the source is delivering again (alarm cleared)", file=sys.stderr, flush=True)
        if self.fail_after_s is not None and self.failing_s is not None and self.failing_s >= self.fail_after_s:
            return f"{self.summary()} (source.fail_after_s = {self.fail_after_s:g})"
        return None

    def summary(self) -> str:
        return (
            f"the source has failed for {self.failing_s or 0:.0f} s with no success "
            f"({self.errors} errors in a row); last error: {(self.last_error or '-')[:300]}"
        )

    def describe(self) -> dict[str, Any]:
        return {
            "active": self.active,
            "failing_s": None if self.failing_s is None else round(self.failing_s, 1),
            "consecutive_errors": self.errors,
            "last_error": self.last_error,
            "alarm_after_s": self.alarm_after_s,
            "fail_after_s": self.fail_after_s,
            "raised": self.raised,
        }


class WriteAlarm:
    """A write the run needs, failed (no disk space, a read-only or failing filesystem), that does
    not end the run: training goes on and the next one retries. Until one succeeds the alarm is up:
    logged, printed on the console, in `ctl status` (`alarms.<name>`) and in Prometheus
    (`grpod_alarm{alarm="<name>"}`)."""

    name = "write"
    meanwhile = "training goes on and the next one retries"

    def __init__(self) -> None:
        self.active = False
        self.raised = 0
        self.failures = 0
        self.since_step: int | None = None
        self.last_error: str | None = None

    def failed(self, step: int, error: str) -> None:
        self.failures += 1
        self.last_error = error
        if not self.active:
            self.active, self.since_step = True, step
            self.raised += 1
        log.error(f"{self.name}_alarm", step=step, error=error, failures=self.failures)
        print(f"grpod: ALARM at step {step}: {self.name} failed, {self.meanwhile}: {error}", file=sys.stderr, flush=True)

    def written(self, step: int) -> None:
        if self.active:
            self.active, self.since_step = False, None
            log.info(f"{self.name}_alarm_cleared", step=step)
            print(f"grpod: {self.name} written at step {step} (alarm cleared)", file=sys.stderr, flush=True)

    def describe(self) -> dict[str, Any]:
        return {
            "active": self.active,
            "since_step": self.since_step,
            "failures": self.failures,
            "last_error": self.last_error,
            "raised": self.raised,
        }


class SyncAlarm(WriteAlarm):
    """A sync whose weights could not be written (`SyncNotSaved`): the engines serve the last
    synced version while the trainer moves on from it; the next sync retries."""

    name = "sync"
    meanwhile = "the engines serve the last synced version, training goes on and the next sync retries"


class CheckpointAlarm(WriteAlarm):
    """A periodic or an operator's checkpoint that failed (`CheckpointNotWritten`: a full or
    read-only filesystem; or any other failure); the next checkpoint retries. (The shutdown
    checkpoint's failure is the run's exit status.)"""

    name = "checkpoint"
    meanwhile = "training goes on and the next checkpoint retries"

    async def guard(self, step: int, checkpoint: Callable[[], Awaitable[dict[str, Any]]]) -> tuple[dict[str, Any] | None, str | None]:
        """(what `checkpoint()` wrote, None), or (None, why it failed) with the alarm raised.
        BrokenTrainerState (weights not worth keeping) raises, alarm or not: the run stops."""
        try:
            return await checkpoint(), None
        except BrokenTrainerState:
            raise
        except Exception as exc:  # noqa: BLE001 — a failed checkpoint is the alarm's, the run goes on
            log.exception("checkpoint_failed")
            error = str(exc) if isinstance(exc, CheckpointNotWritten) else f"{type(exc).__name__}: {exc}"
            self.failed(step, error)
            return None, error
