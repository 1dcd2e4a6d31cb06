"""`CoreLoan`: who may borrow the trainer's cores, and lending / reclaiming around a wait, with
stand-in engines (the real engine's thread change is tested in tests/e2e/test_inference_process.py)."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from grpod.config import parse_config
from grpod.inference.cores import AUTO_MIN_WEIGHT_BYTES, CoreLoan

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class StandInEngine:
    node = "local"

    def __init__(self, name: str = "engine-0", *, fail: Exception | None = None, hang: bool = False) -> None:
        self.name = name
        self.client = object()
        self.threads: int | None = None
        self.calls: list[int] = []
        self.fail, self.hang = fail, hang
        self.available, self.outstanding = True, 0

    async def set_threads(self, threads: int) -> None:
        self.calls.append(threads)
        if self.hang:
            await anyio.sleep_forever()
        if self.fail is not None:
            raise self.fail
        self.threads = threads


def model_dir(tmp_path: Path, size: int) -> Path:
    out = tmp_path / f"model-{size}"
    out.mkdir(exist_ok=True)
    with open(out / "model.safetensors", "wb") as f:
        f.truncate(size)  # sparse: only the size is read
    return out


def plan(tmp_path, *overrides, size=AUTO_MIN_WEIGHT_BYTES, engines=None, gpu=False, ranks=False, leased=True):
    tree: dict = {"inference": {}, "train": {"threads": 1}}
    for key, value in overrides:
        section, name = key.split(".")
        tree[section][name] = value
    cfg = parse_config(tree)
    engines = [StandInEngine()] if engines is None else engines
    return CoreLoan.plan(cfg.inference, cfg.train, model_dir(tmp_path, size), engines, gpu=gpu, trainer_ranks=ranks,
                         leased_requests=leased)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="lending needs a core the engine does not already run on")
def test_who_may_borrow(tmp_path):
    loan = plan(tmp_path)
    assert loan.enabled and loan.borrowed == loan.own + 1, "auto: a model of 64 MiB borrows the trainer's one thread"
    assert not plan(tmp_path, size=AUTO_MIN_WEIGHT_BYTES - 1).enabled
    assert "MiB of weights" in plan(tmp_path, size=1024).reason
    assert plan(tmp_path, ("inference.borrow_trainer_cores", True), size=1024).enabled, "forced on for a small model"
    assert not plan(tmp_path, ("inference.borrow_trainer_cores", False)).enabled
    assert not plan(tmp_path, ("inference.cpu_executor", "mp")).enabled, "a Worker process pins its threads"
    assert not plan(tmp_path, engines=[StandInEngine("a"), StandInEngine("b")]).enabled
    remote = StandInEngine()
    remote.node = "http://10.0.0.2:7900"
    assert not plan(tmp_path, engines=[remote]).enabled, "an agent's engine runs on another machine"
    assert not plan(tmp_path, gpu=True).enabled
    assert not plan(tmp_path, ranks=True).enabled
    assert "already runs" in plan(tmp_path, ("inference.env", {"OMP_NUM_THREADS": str(os.cpu_count())})).reason


async def test_the_engine_holds_the_trainers_threads_while_waiting_and_only_then():
    engine = StandInEngine()
    loan = CoreLoan([engine], own=1, borrowed=2, reason="on")
    async with loan.while_waiting():
        assert engine.threads == 2 and loan.lent
        async with loan.while_waiting():  # already lent: nothing sent
            pass
    assert engine.calls == [2, 1] and engine.threads == 1 and not loan.lent
    described = loan.describe()
    assert described["loans"] == 1 and described["lent_s"] >= 0 and not described["lent"]


async def test_a_failing_or_silent_engine_never_fails_the_wait(monkeypatch):
    import grpod.inference.cores as cores

    monkeypatch.setattr(cores, "LOAN_TIMEOUT_S", 0.05)
    broken, silent, down = StandInEngine("a", fail=RuntimeError("HTTP 500")), StandInEngine("b", hang=True), StandInEngine("c")
    down.client = None
    loan = CoreLoan([broken, silent, down], own=1, borrowed=2, reason="on")
    async with loan.while_waiting():
        pass
    assert broken.calls == [2, 1] and silent.calls == [2, 1] and down.calls == [], "each asked, each let go"
    assert broken.threads is None and silent.threads is None, "unknown threads: lent again next time"


async def test_a_relaunched_engine_is_lent_again(monkeypatch):
    engine = StandInEngine()
    loan = CoreLoan([engine], own=1, borrowed=2, reason="on")
    async with loan.while_waiting():
        engine.threads = None  # relaunched meanwhile: the new process runs on its own threads
    async with loan.while_waiting():
        pass
    assert engine.calls == [2, 1, 2, 1], "lent again at the next wait (the reclaim between is harmless)"


async def test_a_disabled_loan_sends_nothing():
    loan = CoreLoan.off("test")
    async with loan.while_waiting():
        pass
    assert loan.describe() == {"enabled": False, "reason": "test", "engine_threads": 1, "borrowed_threads": 1,
                               "lent": False, "loans": 0, "lent_s": 0.0,
                               "trainer": {"enabled": False, "reason": "not planned", "threads": 0, "borrowed_threads": 0,
                                           "micro_batches": 0}}
    assert loan.trainer_threads(generation_parked=True) == 0, "the trainer's own (0: train.threads unset)"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="lending needs a core the trainer does not already run on")
def test_who_may_lend_the_trainer_an_idle_engines_cores(tmp_path):
    loan = plan(tmp_path)
    assert loan.idle and loan.trainer_own == 1 and loan.trainer_borrowed == min(os.cpu_count(), 1 + loan.own), loan.describe()
    assert plan(tmp_path, ("inference.borrow_trainer_cores", False)).idle, "each way is its own setting"
    assert plan(tmp_path, ("inference.cpu_executor", "mp")).idle, "the engine's threads are not changed"
    two = plan(tmp_path, engines=[StandInEngine("a"), StandInEngine("b")])
    assert two.idle and not two.enabled and two.trainer_borrowed == min(os.cpu_count(), 1 + 2 * two.own)
    assert "MiB of weights" in plan(tmp_path, size=1024).describe()["trainer"]["reason"]
    assert plan(tmp_path, ("train.borrow_engine_cores", True), size=1024).idle, "forced on for a small model"
    off = [
        (plan(tmp_path, ("train.borrow_engine_cores", False)), "= false"),
        (plan(tmp_path, leased=False), "without grpod seeing them"),
        (plan(tmp_path, ("train.threads", os.cpu_count())), "already runs"),
        (plan(tmp_path, ("train.threads", 0)), "already runs"),
        (plan(tmp_path, gpu=True), "CPU"),
        (plan(tmp_path, ranks=True), "torchrun"),
    ]
    remote = StandInEngine()
    remote.node = "http://10.0.0.2:7900"
    off.append((plan(tmp_path, engines=[remote]), "no engine on this node"))
    for loan, reason in off:
        assert not loan.idle and loan.trainer_borrowed == loan.trainer_own and reason in loan.trainer_reason, loan.describe()


def test_the_trainer_borrows_only_while_generation_is_parked_and_every_engine_is_idle():
    a, b = StandInEngine("a"), StandInEngine("b")
    loan = CoreLoan([], own=1, borrowed=1, reason="off", idle=[a, b], trainer_own=1, trainer_borrowed=2, trainer_reason="on")
    assert loan.trainer_threads(generation_parked=True) == 2
    assert loan.trainer_threads(generation_parked=False) == 1, "a worker is about to send a request"
    b.outstanding = 1
    assert loan.trainer_threads(generation_parked=True) == 1, "a request still generating"
    b.outstanding, a.available = 0, False
    assert loan.trainer_threads(generation_parked=True) == 1, "an engine in a sync (or down, relaunching)"
    a.available = True
    assert loan.trainer_threads(generation_parked=True) == 2
