"""`LogprobGapAlarm`: the trainer and vLLM must compute the same logprobs; say so when they do not.

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
from typing import Any

import structlog

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
