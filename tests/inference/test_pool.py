"""The engine pool on its own: members, who is current at which version, leaving on death, and a
lost engine brought back by the bridge's `bring_up` holding the pool's turn (for a pool, only
while it is caught up: the others sync on while it relaunches). Engines are real
`InferenceEngine`s over stand-in processes whose health the test sets; the bridge side of it
(relaunch, catch-up, probe) is `tests/bridges/test_recovery.py`."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from grpod.config import InferenceConfig
from grpod.inference.client import InferenceRequestError
from grpod.inference.pool import EnginePool
from grpod.inference.supervised import SupervisedInference

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


class Client:
    def __init__(self) -> None:
        self.alive = True
        self.core_answers = True
        self.pause_status: int | None = 200  # None: the pause goes unanswered
        self.asked: list[str] = []

    async def health(self, timeout_s=None):
        return self.alive

    async def is_paused(self):
        self.asked.append("/is_paused")
        if not self.core_answers:
            raise InferenceRequestError("/is_paused", None, "timed out after 60 s (inference.stall_timeout_s)")
        return False

    async def pause(self, mode):
        assert mode == "keep", "a weight change keeps the requests in flight"
        self.asked.append("/grpod/pause")
        if self.pause_status != 200:
            raise InferenceRequestError("/grpod/pause", self.pause_status, "timed out after 60 s" if self.pause_status is None else "no")


def engine(name: str, version: int = 0) -> SupervisedInference:
    process = SimpleNamespace(running=True, pid=None, base_url=f"http://127.0.0.1/{name}")
    e = SupervisedInference(process, InferenceConfig(), name=name)
    e.client, e.version = Client(), version
    e.open()
    return e


def pool_of(*engines, bring_up=None) -> EnginePool:
    async def refuse(engine, reason):
        raise AssertionError(f"bring_up({engine.name}) was not expected")

    pool = EnginePool(list(engines), bring_up=bring_up or refuse, owner="test")
    pool.serving = True
    return pool


def test_a_pool_needs_an_engine():
    with pytest.raises(ValueError, match="at least one engine"):
        EnginePool([], bring_up=None, owner="test")


async def test_a_dead_engine_of_a_pool_leaves_it_and_rejoins_once_admitted():
    a, b = engine("a"), engine("b")
    pool = pool_of(a, b)
    b.client.alive = False
    lost = await pool.drop_dead([a, b], ExceptionGroup("probe", [ConnectionResetError("reset")]), version=1)
    assert lost.dead == [b] and lost.left == [b] and lost.remaining == [a] and lost.stranded == []
    assert isinstance(lost.cause, ConnectionResetError), "the task group's wrapper is taken off"
    assert pool.members() == [a] and b.recovering and not b.available and a.available
    pool.mark_current(pool.members(), 2)
    assert (a.version, b.version) == (2, 0), "only the members are marked current"
    pool.mark_current([b], 2)
    pool.admit([b])
    assert pool.members() == [a, b] and b.available and not b.recovering


async def test_the_only_engine_cannot_leave_it_is_stranded_for_the_change_to_relaunch():
    (a,) = engines = [engine("a")]
    pool = pool_of(*engines)
    a.client.alive = False
    lost = await pool.drop_dead([a], RuntimeError("reload failed"), version=1)
    assert lost.dead == [a] and lost.left == [] and lost.stranded == [a] and lost.remaining == [a]
    assert pool.members() == [a] and not a.recovering


async def test_nothing_dead_is_no_casualty():
    a, b = engine("a"), engine("b")
    lost = await pool_of(a, b).drop_dead([a, b], RuntimeError("refused"), version=1)
    assert lost.dead == [] and lost.left == [] and lost.remaining == [a, b]


@pytest.mark.parametrize(
    ("serving", "healthy", "stalled", "brought_up"),
    [
        (True, False, False, True),  # lost while the bridge serves: brought back
        (False, False, False, False),  # the bridge starts, failed or stops: left as it is
        (True, True, False, False),  # answers again: a sync met the loss first and relaunched it
        (True, True, True, True),  # answers /health but its watch found it stalled: brought back
    ],
)
async def test_recover_brings_a_lost_engine_back_only_while_the_bridge_serves(serving, healthy, stalled, brought_up):
    a, b = engine("a"), engine("b")
    calls = []

    async def bring_up(engine, reason):
        calls.append((engine.name, reason, engine.recovering, engine.available))

    pool = pool_of(a, b, bring_up=bring_up)
    pool.serving = serving
    b.client.alive, b.stalled = healthy, stalled
    await pool.recover(b, "vLLM exited with code -9")
    assert calls == ([("b", "vLLM exited with code -9", True, False)] if brought_up else [])


@pytest.mark.parametrize("how", ["found stalled by its watch", "its core does not answer"])
async def test_a_stalled_engine_that_answers_health_is_a_casualty_of_a_failed_change(how):
    a, b = engine("a"), engine("b")
    if how == "found stalled by its watch":
        b.stalled = True
    else:
        b.client.core_answers = False
    lost = await pool_of(a, b).drop_dead([a, b], TimeoutError("pause"), version=1)
    assert lost.dead == [b] and lost.left == [b] and lost.remaining == [a]
    assert b.stalled and not a.stalled


@pytest.mark.parametrize(
    ("alive", "pause_status", "stalled", "lost", "asked"),
    [
        (True, None, True, True, ["/grpod/pause"]),  # answers /health, its core not the pause: stalled, asked no more
        (False, None, False, True, ["/grpod/pause"]),  # the server is gone: lost by /health
        (True, 500, False, False, ["/grpod/pause", "/is_paused"]),  # an error answer is an answer
    ],
)
async def test_a_pause_its_core_leaves_unanswered_marks_an_engine_that_answers_health_stalled(
    alive, pause_status, stalled, lost, asked
):
    a = engine("a")
    a.client.alive, a.client.pause_status = alive, pause_status
    with pytest.raises(InferenceRequestError):
        await a.pause()
    assert not a.available, "the gate is shut before the pause is asked"
    assert a.stalled == stalled
    assert await a.lost() == lost
    assert a.client.asked == asked


async def test_an_engine_that_left_a_sync_with_a_silent_core_is_brought_back_by_its_watch():
    """Review D1: the sync's pause met a core that does not answer while /health does; the engine
    left the pool (gate shut) and its watch — /health fine, no token counters read with the gate
    shut — never found it lost: it stayed out of the pool for the rest of the run."""
    a, b = engine("a"), engine("b")
    b.cfg = b.cfg.model_copy(update={"health_interval_s": 0.01})
    never_exits = anyio.Event()

    async def wait_exit():
        await never_exits.wait()

    b.process.wait_exit = wait_exit
    brought_up = []
    found = anyio.Event()

    async def bring_up(engine, reason):
        brought_up.append((engine.name, reason))
        found.set()

    pool = pool_of(a, b, bring_up=bring_up)
    b.client.pause_status = None  # the core leaves the pause unanswered; /health stays 200
    with pytest.raises(InferenceRequestError):
        await b.pause()
    lost = await pool.drop_dead([b], TimeoutError("pause"), version=1)
    assert lost.left == [b] and b.recovering and b.stalled and await b.healthy()
    async with anyio.create_task_group() as tg:
        tg.start_soon(b.watch, pool.recover)
        with anyio.move_on_after(5):
            await found.wait()
        tg.cancel_scope.cancel()
    assert brought_up and brought_up[0][0] == "b" and "engine core did not answer" in brought_up[0][1], brought_up


async def test_a_pool_syncs_on_while_one_engine_relaunches_and_the_only_engine_holds_the_turn():
    """`syncs_meanwhile` lets go of the turn for a pool's relaunch and takes it back after; the
    only engine's recovery keeps it (there is nothing to sync without it)."""
    events = []

    async def bring_up(engine, reason):
        async with pool.syncs_meanwhile():
            events.append(f"relaunch {engine.name}")
            await relaunched.wait()
        events.append(f"catch up {engine.name}")
        pool.admit([engine])

    async def sync():
        async with pool.turn:
            events.append("sync")

    for engines, expected in (
        ([engine("a"), engine("b")], ["relaunch b", "sync", "catch up b"]),
        ([engine("b")], ["relaunch b", "catch up b", "sync"]),
    ):
        events.clear()
        relaunched = anyio.Event()
        pool = pool_of(*engines, bring_up=bring_up)
        lost = engines[-1]
        lost.client.alive = False
        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(pool.recover, lost, "lost")
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(sync)
                await anyio.wait_all_tasks_blocked()
                relaunched.set()
        assert events == expected
        assert lost.available and not lost.recovering and pool.turn.value == 1


async def test_what_a_recovery_raises_ends_the_watches_unwrapped():
    class Budget(RuntimeError):
        pass

    async def spent(engine, reason):
        raise Budget(f"{engine.name}: budget spent")

    a = engine("a")
    exited = anyio.Event()
    a._until_exited = lambda: _exited(exited)
    pool = pool_of(a, bring_up=spent)
    a.client.alive = False
    exited.set()
    with anyio.fail_after(5), pytest.raises(Budget, match="a: budget spent"):
        await pool.watch()


async def _exited(event: anyio.Event) -> str:
    await event.wait()
    return "vLLM exited with code -9"


def test_describe_shows_the_first_engine_as_vllm_and_every_engine():
    a, b = engine("a"), engine("b")
    status = pool_of(a, b).describe()
    assert status["restarts"] == 0 and status["vllm"]["base_url"] == "http://127.0.0.1/a"
    assert [e["name"] for e in status["engines"]] == ["a", "b"]
