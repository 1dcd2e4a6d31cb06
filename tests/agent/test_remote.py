"""RemoteInference, the leader's engine on an agent, against an agent served in-process over
stand-in engines: launch through the agent and talk to the engine directly (its token checked),
the watch that hears a crash through the agent, the relaunch that takes over the agent's own, and
the wiring from `[cluster]`."""

from __future__ import annotations

from contextlib import asynccontextmanager

import anyio
import pytest

from grpod.agent.api import AgentRequestError
from grpod.agent.remote import RemoteInference, agents_memory
from grpod.config import GrpodConfig, InferenceConfig
from grpod.daemon.components import build_engines
from grpod.inference.client import ForeignServerError
from grpod.inference.policy import Policy
from grpod.inference.release import free_port
from tests.agent.conftest import TOKEN, crash, serving, stub_engines

pytestmark = pytest.mark.anyio

FAST = InferenceConfig(health_interval_s=0.05, health_failures=2, request_timeout_s=10, start_timeout_s=30, max_restarts=2)


def remote(url: str, token: str = TOKEN, engine: str = "engine-0") -> RemoteInference:
    return RemoteInference(url, token, FAST, engine=engine, name=f"{url.split('://')[1]}/{engine}", gpu=False,
                           request_timeout_s=10)


@asynccontextmanager
async def answering(handler):
    """A web server on a free loopback port that answers every route with `handler`: what stands
    where an agent or an engine should be. Yields the port."""
    from aiohttp import web

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port("127.0.0.1")
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield port
    finally:
        await runner.cleanup()


async def test_launch_through_the_agent_then_talk_to_the_engine_directly(tmp_path, weights):
    [local] = stub_engines(tmp_path)
    async with serving([local]) as (_, url):
        engine = remote(url)
        await engine.launch(weights, 5, worker_extension="pkg.mod.Ext", extra_args=["--seed", "0"])
        try:
            assert engine.process.running and engine.process.base_url == local.process.base_url
            assert engine.process.launch_token == local.client.launch_token
            assert await engine.healthy() and await engine.client.weight_version() == "5"
            assert engine.version == 5 and engine.launches == 1 and engine.weights == weights
            described = engine.describe()
            assert described["node"] == url and described["state"] == "closed" and described["agent"]["reachable"]
            # its process group, as the agent reads it on its node: one /status for both names
            twin = remote(url, engine="engine-0")
            twin.name = "leader-side/engine-0"

            async def not_asked():
                raise AssertionError("one /status per agent: the first engine's")

            twin.agent_status = not_asked
            both = await agents_memory([engine, twin])
            held = both[engine.name]
            assert held["rss"] > 10 * 2**20 and held["gpu"] is None, held
            assert both[twin.name] == held and engine.agent_seen is not None
            engine.open()
            async with Policy([engine], version=5).engine(1) as lease:
                assert lease.engine is engine and lease.version == 5
        finally:
            await engine.shutdown()
        assert not engine.process.running and not local.process.running and engine.client is None
        assert (await agents_memory([engine])).get(engine.name) is None, "a stopped engine holds nothing"


async def test_the_token_proves_which_launch_answers(tmp_path, weights):
    """A client holding an older launch's token refuses the new launch's answers on the same port."""
    [local] = stub_engines(tmp_path)
    async with serving([local]) as (_, url):
        engine = remote(url)
        await engine.launch(weights, 0)
        stale = engine.process.client()
        await engine.relaunch(weights, 0)  # the stub keeps its port (free again at once)
        try:
            assert stale.base_url == engine.process.base_url
            async with stale:
                with pytest.raises(ForeignServerError):
                    await stale.health()
            assert await engine.healthy()
        finally:
            await engine.shutdown()


async def test_a_crash_is_heard_through_the_agent_and_the_relaunch_takes_over_the_agents(tmp_path, weights):
    [local] = stub_engines(tmp_path, max_restarts=2)
    async with serving([local]) as (agent, url):
        engine = remote(url)
        await engine.launch(weights, 7)
        engine.open()
        first_launch = engine.process.launch
        reasons: list[str] = []
        phases: dict[str, float] = {}

        async def on_lost(lost, reason: str) -> None:
            """What the bridge does: budget, relaunch on the same weights, serve again."""
            reasons.append(reason)
            assert not await lost.healthy()
            lost.spend_restart(reason)
            with anyio.fail_after(30):  # let the agent's own relaunch win, to take it over
                while agent.engines[0].engine.launches < 2 or not local.process.running:
                    await anyio.sleep(0.05)
            await lost.relaunch(weights, 7, phases)
            lost.open()

        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.watch, on_lost)
            await anyio.sleep(0.2)
            await crash(local)
            with anyio.fail_after(30):
                while engine.launches < 2:
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
        try:
            assert len(reasons) == 1 and "exited with code -9" in reasons[0], reasons
            assert engine.process.launch != first_launch and engine.process.launch == agent.engines[0].launch_id
            assert agent.engines[0].engine.launches == 2, "taken over: no second vLLM start"
            assert engine.restarts == 1 and agent.engines[0].engine.restarts == 1
            assert await engine.healthy() and engine.available and await engine.client.weight_version() == "7"
            assert set(phases) == {"stop", "launch"}
        finally:
            await engine.shutdown()


async def test_a_wrong_token_and_an_absent_agent_are_errors_that_say_so(tmp_path, weights):
    [local] = stub_engines(tmp_path)
    async with serving([local]) as (_, url):
        with pytest.raises(AgentRequestError) as refused:
            await remote(url, token="not-the-token-0123456789").launch(weights, 0)
        assert refused.value.status == 401 and not local.process.running
    gone = RemoteInference(f"http://127.0.0.1:{free_port('127.0.0.1')}", TOKEN, FAST.model_copy(update={"start_timeout_s": 1.0}),
                           engine="engine-0", name="gone/engine-0", gpu=False, request_timeout_s=10)
    with anyio.fail_after(30):
        with pytest.raises(AgentRequestError) as unreachable:
            await gone.launch(weights, 0)  # asked again for inference.start_timeout_s, then the error
    assert unreachable.value.status is None
    assert await agents_memory([gone]) == {}, "an agent that does not answer leaves its engines out"
    await gone.shutdown()  # logged, never raised: the agent replaces what it runs at its next launch
    assert gone.describe()["agent"]["reachable"] is False and "no response" in gone.describe()["agent"]["error"]


def test_cluster_agents_become_remote_engines_beside_the_local_ones(tmp_path):
    cfg = GrpodConfig.model_validate({
        "run": {"dir": str(tmp_path)},
        "inference": {"engines": 1},
        "bridge": {"mode": "broadcast", "host": "10.0.0.1"},
        "cluster": {"agents": ["http://10.0.0.2:7900", "http://10.0.0.3"], "token": TOKEN, "engines_per_agent": 2},
    })  # fmt: skip
    engines = build_engines(cfg, tmp_path)
    assert [e.name for e in engines] == [
        "engine-0", "10.0.0.2:7900/engine-0", "10.0.0.2:7900/engine-1", "10.0.0.3:7900/engine-0", "10.0.0.3:7900/engine-1",
    ]  # fmt: skip
    assert [e.node for e in engines] == ["local"] + ["http://10.0.0.2:7900"] * 2 + ["http://10.0.0.3:7900"] * 2
    assert all(not e.process.running and e.describe()["base_url"] is None for e in engines)
    assert engines[1].describe()["agent"]["reachable"] is None, "not asked yet"


async def test_a_launch_waits_for_an_agent_that_is_restarting(tmp_path, weights):
    """The agent is down when the leader asks (systemd restarts it after RestartSec): the launch is
    asked again until the agent answers, within inference.start_timeout_s, not failed at once."""
    [local] = stub_engines(tmp_path)
    port = free_port("127.0.0.1")
    engine = remote(f"http://127.0.0.1:{port}")
    answered = []

    async def agent_back_later():
        await anyio.sleep(2.0)
        async with serving([local], port=port) as (_, url):
            answered.append(url)
            await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(agent_back_later)
        try:
            with anyio.fail_after(60):
                await engine.launch(weights, 3)
            assert answered and await engine.healthy() and engine.version == 3
        finally:
            await engine.shutdown()
            tg.cancel_scope.cancel()


async def test_a_stop_does_not_wait_minutes_for_a_silent_agent(tmp_path, weights):
    """An agent frozen (or its node gone) after the launch: `ctl stop` used to wait the whole stop
    timeout for it (760 s with the defaults); now one status request within
    `cluster.request_timeout_s` tells, and the daemon stops without it."""
    import socket
    import time

    [local] = stub_engines(tmp_path)
    async with serving([local]) as (_, url):
        engine = RemoteInference(url, TOKEN, FAST, engine="engine-0", name="frozen/engine-0", gpu=False,
                                 request_timeout_s=2)
        await engine.launch(weights, 1)
        assert engine._change_timeout_s > 60
        # What a SIGSTOPped agent is on the wire: the kernel accepts the connection, nobody answers.
        silent = socket.create_server(("127.0.0.1", 0))
        engine.agent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        try:
            started = time.monotonic()
            await engine.shutdown()
            waited = time.monotonic() - started
        finally:
            silent.close()
        assert waited < 10, f"waited {waited:.1f} s for a silent agent"
        assert not engine.process.running and engine.describe()["agent"]["reachable"] is False
        assert local.process.running, "not stopped: the agent stops its engines at its own shutdown"


async def test_another_service_at_the_agents_address_is_named_as_such(tmp_path, weights):
    """A web server's page where the agent should be (a wrong port in cluster.agents): the error
    says it is not an agent's answer, where it said "malformed launch answer: Field required"."""
    from aiohttp import web

    async def page(request):
        return web.Response(text="<html>It works!</html>", content_type="text/html")

    async with answering(page) as port:
        with pytest.raises(AgentRequestError) as wrong:
            await remote(f"http://127.0.0.1:{port}").launch(weights, 0)
    assert "not a grpod agent's answer (not JSON, text/html): <html>It works!" in str(wrong.value), wrong.value


@pytest.mark.parametrize("body", [b'{"error": {"code": 500, "message": "proxy"}}', b"\xff\xfe not utf-8"])
async def test_an_odd_answer_is_an_agent_request_error_not_a_raw_exception(tmp_path, body):
    """A JSON error whose `error` is not text (TypeError: unhashable 'slice') and a body that is not
    UTF-8 (UnicodeDecodeError) escaped both HTTP clients raw: in the leader's watch, past the
    handler for an unreachable agent, ending the run."""
    from aiohttp import web

    from grpod.agent.api import AgentClient
    from grpod.inference.client import InferenceClient, InferenceRequestError

    async def odd(request):
        return web.Response(body=body, status=500, content_type="application/json")

    async with answering(odd) as port:
        async with AgentClient(f"http://127.0.0.1:{port}", TOKEN, 10) as agent:
            with pytest.raises(AgentRequestError):
                await agent.status()
        async with InferenceClient(f"http://127.0.0.1:{port}", 10) as client:
            assert await client.health() is False
            with pytest.raises(InferenceRequestError):
                await client.is_paused()


async def test_an_agent_that_no_longer_serves_the_engine_is_a_lost_engine_not_a_silent_retry(tmp_path, weights):
    """An agent restarted with fewer engines answers 404 for this one: the watch retried it every
    few seconds forever, in silence, and the agent showed as reachable. Now the engine is lost,
    saying why (its relaunch through the agent then fails, within the restart budget)."""
    from aiohttp import web

    async def gone(request):
        return web.json_response({"error": "no engine named engine-0"}, status=404)

    [local] = stub_engines(tmp_path)
    async with answering(gone) as port, serving([local]) as (_, url):
        engine = remote(url)
        await engine.launch(weights, 1)
        try:
            engine.agent_url = f"http://127.0.0.1:{port}"
            with anyio.fail_after(10):
                reason = await engine._until_exited()
            assert "no longer serves engine-0" in reason and "no engine named engine-0" in reason, reason
        finally:
            engine.agent_url = url
            await engine.shutdown()
