"""The operator desk alone: requests become events and a queue the step loop serves; any number
of waiters are woken by one change (no shared wait slot, no polling). Milliseconds, no daemon."""

from __future__ import annotations

import anyio
import pytest

from grpod.config import load_config
from grpod.daemon.control import ControlError
from grpod.daemon.desk import OperatorDesk
from grpod.daemon.progress import RunProgress

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def desk(tmp_path):
    cfg = load_config(None, [f"run.dir={str(tmp_path)!r}"])
    return OperatorDesk(cfg, RunProgress(cfg.train.steps), status=lambda: {"state": "running"})


def test_the_commands_are_the_desks_ctl_methods(desk):
    assert OperatorDesk.commands() == ("checkpoint", "drain", "pause", "resume", "set", "status", "stop", "sync")
    assert set(desk.handlers()) == set(OperatorDesk.commands())


async def test_one_change_wakes_every_waiter_at_once(desk):
    """Two loops racing their waits against the desk (the old shared scope slot let the second
    waiter overwrite the first's, which then fell back to a 1 s poll)."""
    interrupted = []

    async def waiter(name: str) -> None:
        result = await desk.first_or_attention(anyio.sleep_forever)
        interrupted.append((name, result))

    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter, "a")
            tg.start_soon(waiter, "b")
            await anyio.wait_all_tasks_blocked()
            await desk.ctl_set({"key": "train.lr", "value": 3e-4})
    assert sorted(interrupted) == [("a", None), ("b", None)]
    assert desk.pending(), "the change waits for the loop's boundary"


async def test_work_that_finishes_first_returns_its_result(desk):
    async def work() -> str:
        await anyio.sleep(0)
        return "done"

    assert await desk.first_or_attention(work) == "done"
    desk.wake()
    assert await desk.first_or_attention(work) is None, "woken and not settled: the loop must look first"
    desk.settle()
    assert await desk.first_or_attention(work) == "done"


async def test_a_boundary_request_replies_when_the_loop_served_it(desk):
    replies = []

    async def operator() -> None:
        replies.append(await desk.ctl_checkpoint({}))

    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            tg.start_soon(operator)
            await anyio.wait_all_tasks_blocked()
            assert replies == [] and desk.has_request("checkpoint")
            (request,) = desk.take_requests("checkpoint")
            request.complete({"path": "step-000003"})
    assert replies == [{"path": "step-000003"}] and not desk.has_request("checkpoint")


async def test_requests_fail_clearly_once_the_daemon_stops(desk):
    async def operator() -> None:
        with pytest.raises(ControlError, match="the daemon is stopping"):
            await desk.ctl_sync({})

    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            tg.start_soon(operator)
            await anyio.wait_all_tasks_blocked()
            desk.fail_requests("the daemon is stopping")
    with pytest.raises(ControlError, match="stopping"):
        desk.request_stop("SIGTERM")
        await desk.ctl_checkpoint({})


async def test_pause_holds_sources_until_resume(desk):
    generated = []

    async def source() -> None:
        for i in range(3):
            await desk.wait_resumed()
            generated.append(i)
            await anyio.sleep(0)

    await desk.ctl_pause({})
    with anyio.fail_after(1):
        async with anyio.create_task_group() as tg:
            tg.start_soon(source)
            await anyio.wait_all_tasks_blocked()
            assert generated == [], "a paused daemon asks the source for nothing"
            reply = await desk.ctl_resume({})
    assert reply["was_paused"] and generated == [0, 1, 2]


async def test_the_first_stop_reason_stands(desk):
    desk.request_stop("SIGTERM")
    desk.request_stop("ctl stop")
    assert desk.stop_requested and desk.progress.stop_reason == "SIGTERM"
    reply = await desk.ctl_drain({})
    assert reply["draining"] and desk.drained.is_set()


async def test_a_bad_setting_is_refused_and_nothing_is_queued(desk):
    with pytest.raises(ControlError, match="cannot change while running"):
        await desk.ctl_set({"key": "model.path", "value": "/elsewhere"})
    with pytest.raises(ControlError, match="expected args"):
        await desk.ctl_set({"key": "train.lr"})
    assert not desk.pending()


async def test_a_drain_resumes_a_paused_run_to_train_what_is_buffered(desk):
    """`ctl drain` while paused did nothing until `ctl resume` (35 s and still `paused`): the
    drain lifts the pause, so the buffered groups train, the checkpoint is written, and it stops."""
    await desk.ctl_pause({})
    reply = await desk.ctl_drain({})
    assert reply["draining"] and reply["was_paused"] and not desk.paused
    with anyio.fail_after(1):
        await desk.wait_resumed()
