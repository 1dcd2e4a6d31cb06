"""`CoreLoan`: on a CPU machine, the trainer's cores go to the engine while the trainer waits, and
the engine's to the trainer while the engine has nothing to do.

grpod runs a CPU engine on the cores the trainer leaves it (`OMP_NUM_THREADS` = cores - 1 on one
machine, `process.default_env`) and the trainer on `train.threads`. With generation overlapped,
the trainer is idle whenever it waits for the next batch: in a 15-minute SmolLM2-135M run here
(`bench/peers`, before the loan), the daemon used 0.45 of a core and the engine 0.97 between
the first and the last step, so half a core sat idle. The loan gives the engine the trainer's threads for the wait (`lend`) and takes
them back before the step trains (`reclaim`), through the engine's `grpod_set_threads`
(`grpod.inference.threads_ext`), which acts between two engine steps. A reclaim therefore waits
at most one engine step; an engine that does not answer within LOAN_TIMEOUT_S is left as it is
(logged), and the loan is never a reason for a step to fail.

Who may borrow (`inference.borrow_trainer_cores`):
- one engine on this node, on the CPU, its worker inside EngineCore ("uni": its threads are not
  pinned, and the call runs in the thread that runs the model), a trainer on the CPU in this one
  process (trainer ranks under torchrun have the cores to themselves);
- "auto" adds: a model of at least AUTO_MIN_WEIGHT_BYTES of weights. Measured here
  (`bench/results/core_loan.json`): SmolLM2-135M (513 MiB) generated 1.17x the tokens/s on two
  threads, the tiny built-in model (1.7 MiB) 0.77x: its engine step is Python-bound and a second
  thread only adds synchronisation. Between the two nothing was measured; 64 MiB is a round
  number between them, and `true` / `false` settle it for a model in that range.

The other way (`train.borrow_engine_cores`): the trainer sets the pace on short-completion tasks,
and the prefetch queue is then full most of a step. Generation stops while it is full (a worker
holds its finished group until the next step takes a batch), and once the requests in flight have
finished the engine does nothing until the next step. Before each micro-batch the trainer asks
`trainer_threads`: while generation is parked (the queue full, or no overlap) and every local
engine is serving with no request outstanding, it runs on its threads plus the engine's; otherwise
on its own. Only the next step's batch restarts generation, and an evaluation or a sync starts at a
step boundary, so a micro-batch on borrowed threads does not meet a working engine; the trainer
is on its own threads again after each phase. It needs a source whose requests all go through
grpod's engine leases (`dataset`, `builtin`): an environment reaches vLLM directly, unseen.
Measured (docs/performance.md): a SmolLM2 step of the format task's batches took 8.58 s on two
threads against 12.41 s on one (`bench/results/shared_prompt-threads.json`); live on that task the
engine was idle at only 2 of 126 micro-batch boundaries, because with `source.concurrency` above
`prefetch_groups` the workers go on generating beside a full queue. It pays where the engine idles
for whole steps (`source.overlap = false`), or where the workers are no more than the queue holds.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import anyio
import structlog

from grpod.config import InferenceConfig, TrainConfig
from grpod.inference.engine import InferenceEngine

log = structlog.get_logger(__name__)

# An engine that has not applied a thread change after this long is left as it is (logged).
LOAN_TIMEOUT_S = 10.0
# "auto": the weights a model needs before a second engine thread pays (64 MiB of safetensors).
AUTO_MIN_WEIGHT_BYTES = 64 * 2**20


def engine_threads(cfg: InferenceConfig) -> int:
    """The threads a CPU engine runs on as grpod launches it (`OMP_NUM_THREADS` of its environment)."""
    from grpod.inference.process import default_env

    value = cfg.env.get("OMP_NUM_THREADS") or default_env(cfg, gpu=False).get("OMP_NUM_THREADS")
    return int(value) if value and value.isdigit() else 1


def weight_bytes(model_path: Path) -> int:
    return sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))


class CoreLoan:
    """Lends `borrowed - own` threads to `engines` while the trainer waits (see the module docstring).
    Disabled (`engines` empty) it does nothing and says why (`reason`)."""

    def __init__(self, engines: list[InferenceEngine], *, own: int, borrowed: int, reason: str,
                 idle: list[InferenceEngine] | None = None, trainer_own: int = 0, trainer_borrowed: int = 0,
                 trainer_reason: str = "not planned") -> None:
        """`engines` get `borrowed - own` threads while the trainer waits; while the `idle` engines
        have nothing to do, the trainer runs on `trainer_borrowed` threads instead of `trainer_own`."""
        self.engines = engines
        self.own, self.borrowed = own, borrowed
        self.reason = reason
        self.idle = idle or []
        self.trainer_own, self.trainer_borrowed = trainer_own, trainer_borrowed
        self.trainer_reason = trainer_reason
        self.trainer_loans = 0  # micro-batches the trainer ran on the engines' threads too
        self.lent = False
        self.loans = 0
        self.lent_s = 0.0
        self._since: float | None = None

    @classmethod
    def plan(
        cls, inference: InferenceConfig, train: TrainConfig, model_path: Path, engines: list[InferenceEngine],
        *, gpu: bool, trainer_ranks: bool, leased_requests: bool = True,
    ) -> CoreLoan:
        """The loans this run's config allows, each disabled saying why not where it is not.
        `leased_requests`: every request of the source goes through an engine lease (`outstanding`)."""
        from grpod.inference.process import cpu_executor

        local = [engine for engine in engines if engine.node == "local"]
        own = engine_threads(inference)
        cores = os.cpu_count() or 1
        trainer_own = train.threads or cores
        size = weight_bytes(model_path)
        common = None
        if gpu or train.device != "cpu":
            common = "not a CPU engine and a CPU trainer"
        elif trainer_ranks:
            common = "trainer ranks under torchrun use the cores"
        elif not local:
            common = "no engine on this node"

        def small(setting: Literal["auto"] | bool) -> str | None:
            if setting == "auto" and size < AUTO_MIN_WEIGHT_BYTES:
                return (f"auto: {size / 2**20:.1f} MiB of weights (a second thread pays from "
                        f"{AUTO_MIN_WEIGHT_BYTES / 2**20:.0f} MiB)")
            return None

        lend = common or small(inference.borrow_trainer_cores)
        if inference.borrow_trainer_cores is False:
            lend = "inference.borrow_trainer_cores = false"
        elif not lend and (len(local) != 1 or cpu_executor(inference) != "uni"):
            lend = "needs one engine on this node with its worker inside EngineCore (cpu_executor uni)"
        elif not lend and min(cores, own + trainer_own) <= own:
            lend = f"the engine already runs on {own} of {cores} cores"
        borrow = common or small(train.borrow_engine_cores)
        if train.borrow_engine_cores is False:
            borrow = "train.borrow_engine_cores = false"
        elif not borrow and not leased_requests:
            borrow = "the source's requests reach vLLM without grpod seeing them"
        elif not borrow and trainer_own >= cores:
            borrow = f"the trainer already runs on {trainer_own} of {cores} cores"
        return cls(
            [] if lend else local, own=own, borrowed=own if lend else min(cores, own + trainer_own), reason=lend or "on",
            idle=[] if borrow else local, trainer_own=trainer_own,
            trainer_borrowed=trainer_own if borrow else min(cores, trainer_own + own * len(local)),
            trainer_reason=borrow or "on",
        )

    @classmethod
    def off(cls, reason: str, *, own: int = 1) -> CoreLoan:
        """A loan that lends nothing (`reason` says why)."""
        return cls([], own=own, borrowed=own, reason=reason)

    @property
    def enabled(self) -> bool:
        return bool(self.engines)

    def trainer_threads(self, generation_parked: bool) -> int:
        """The threads the trainer's next micro-batch may run on (called from its worker thread):
        its own and the engines' while generation is parked and every engine serves, idle."""
        if self.idle and generation_parked and all(e.available and e.outstanding == 0 for e in self.idle):
            self.trainer_loans += 1
            return self.trainer_borrowed
        return self.trainer_own

    @asynccontextmanager
    async def while_waiting(self) -> AsyncIterator[None]:
        """The engines hold the trainer's threads inside, and give them back on the way out."""
        await self.lend()
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await self.reclaim()

    async def lend(self) -> None:
        if not self.enabled or self.lent:
            return
        self.lent, self.loans, self._since = True, self.loans + 1, time.monotonic()
        await self._set_all(self.borrowed)

    async def reclaim(self) -> None:
        if not self.lent:
            return
        self.lent = False
        if self._since is not None:
            self.lent_s += time.monotonic() - self._since
            self._since = None
        await self._set_all(self.own)

    async def _set_all(self, threads: int) -> None:
        for engine in self.engines:
            if engine.client is None or engine.threads == threads:
                continue  # down (a relaunch starts on its own threads), or already there
            with anyio.move_on_after(LOAN_TIMEOUT_S) as scope:
                try:
                    await engine.set_threads(threads)
                except Exception as exc:  # noqa: BLE001 — the loan is an optimisation, never a failure
                    log.warning("core_loan_failed", engine=engine.name, threads=threads, error=str(exc)[:300])
            if scope.cancelled_caught:
                log.warning("core_loan_failed", engine=engine.name, threads=threads,
                            error=f"no answer within {LOAN_TIMEOUT_S:g} s")

    def describe(self) -> dict[str, Any]:
        lent_s = self.lent_s + (time.monotonic() - self._since if self._since is not None else 0.0)
        return {"enabled": self.enabled, "reason": self.reason, "engine_threads": self.own,
                "borrowed_threads": self.borrowed, "lent": self.lent, "loans": self.loans, "lent_s": round(lent_s, 1),
                "trainer": {"enabled": bool(self.idle), "reason": self.trainer_reason, "threads": self.trainer_own,
                            "borrowed_threads": self.trainer_borrowed, "micro_batches": self.trainer_loans}}
