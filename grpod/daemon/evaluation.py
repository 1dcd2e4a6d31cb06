"""`Evaluations`: the run's held-out evaluations, as the step loop asks for them.

An evaluation decodes the held-out set through the engines (the source's `evaluate`), so what it
measures is the policy version the engines serve while it runs. It runs one of two ways:

- beside training (`eval.overlap`, where the bridge ships a copy of the weights): a task of the
  step loop's work group, while the loop goes on training. The engines keep the evaluated
  version until it ends: a sync that falls due meanwhile waits (`holds_syncs`), and the loop runs
  it at the first step after the evaluation, so the steps in between train on rollouts a version
  or two older than usual (the importance-sampling correction covers them; `train.max_staleness`
  still bounds them). On SmolLM2 here a 20-row evaluation shares the engine with the training
  rollouts for 60-90 s, which the step loop used to wait out (459 of 850 s of one run).
- in line: the loop waits for it. Always so with the `shared` bridge, whose every optimizer
  update writes the weights the engines serve.

One evaluation runs at a time: asking for the next while one runs waits for it. The record says
which step's policy it measured (`step`: the step loop syncs the trainer's steps before an
evaluation, but a stop's last evaluation measures what the engines serve), the version, and how
long it took (`eval_s`).
"""

from __future__ import annotations

import time

import anyio
import structlog
from anyio.abc import TaskGroup

from grpod.config import EvalConfig
from grpod.errors import first_error
from grpod.daemon.progress import RunProgress

log = structlog.get_logger(__name__)


class Evaluations:
    def __init__(self, cfg: EvalConfig, *, source, reporter, progress: RunProgress, beside_training: bool) -> None:
        self.cfg = cfg
        self.source = source
        self.reporter = reporter
        self.progress = progress
        self.beside_training = beside_training
        self._idle = anyio.Event()
        self._idle.set()
        self._running: dict | None = None  # {"when", "step", "began"} of the one running
        self._said_none = False  # the source has no held-out set, and the log said so

    @property
    def holds_syncs(self) -> bool:
        """True while an evaluation runs beside training: the engines must keep its version."""
        return self._running is not None and self.beside_training

    def describe(self) -> dict | None:
        """The running evaluation (`ctl status`), or None."""
        if self._running is None:
            return None
        return {"when": self._running["when"], "step": self._running["step"],
                "running_s": round(time.monotonic() - self._running["began"], 1), "beside_training": self.beside_training}

    async def idle(self) -> None:
        """Return once no evaluation runs (bounded by the evaluation's own request timeouts)."""
        await self._idle.wait()

    async def run(self, when: str, work: TaskGroup | None, *, step: int | None = None, version: int | None = None) -> None:
        """Evaluate the served policy now: beside training in `work` (when given and allowed), or
        in line. Skipped without `eval.size`. `step`: the step whose weights the engines serve
        (the record's `step`; by default the run's step). With `version` (the policy version served now): if
        the last evaluation measured that version, its result is recorded again as `when`'s
        (`reused`) rather than decoded again: a stop during a periodic evaluation waited for it,
        then evaluated the same weights once more (11 s on SmolLM2, 20 rows)."""
        if self.cfg.size <= 0:
            return
        await self.idle()
        last = self.progress.last_eval
        if version is not None and last.get("policy_version") == version:
            result = {k: v for k, v in last.items() if k not in ("when", "step", "finished_step")}
            self.reporter.eval_done({**result, "reused": last["when"]}, when, step=last["step"])
            return
        step = self.progress.step if step is None else step
        self._running = {"when": when, "step": step, "began": time.monotonic()}
        self._idle = anyio.Event()
        if self.beside_training and work is not None:
            work.start_soon(self._evaluate)
        else:
            await self._evaluate()

    async def _evaluate(self) -> None:
        running = self._running
        assert running is not None
        try:
            result = await self.source.evaluate(self.cfg.size, self.cfg.max_tokens)
            if result is None and not self._said_none:
                # Atropos environments and replays have no held-out set of grpod's: say so once.
                self._said_none = True
                log.warning("eval_unavailable", source=type(self.source).__name__,
                            why=f"this source has no held-out set: eval.size = {self.cfg.size} evaluates nothing")
        except Exception as exc:  # noqa: BLE001 — an evaluation failure is reported, not fatal
            error = first_error(exc) or exc
            log.warning("eval_failed", when=running["when"], step=running["step"], error=f"{type(error).__name__}: {error}"[:300])
            result = None
        finally:
            self._running = None
            self._idle.set()
        if result is not None:
            seconds = round(time.monotonic() - running["began"], 3)
            self.reporter.eval_done({**result, "eval_s": seconds}, running["when"], step=running["step"])
