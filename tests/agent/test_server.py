"""The agent's API with stand-in engines: the token on every route, clear 400s for anything
malformed (the agent stays up), launch / status / stop, and the agent's own relaunch of a crashed
engine, handed to the leader once."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import TypeVar

import aiohttp
import anyio
import pytest

from grpod.agent.api import AgentClient, AgentRequestError, LaunchRequest
from grpod.inference.release import group_members
from grpod.inference.routes import LAUNCH_HEADER
from tests.agent.conftest import TOKEN, crash, serving, stub_engines

pytestmark = pytest.mark.anyio

AUTH = {"Authorization": f"Bearer {TOKEN}"}
T = TypeVar("T")


async def _raw(method: str, url: str, *, headers=None, data=None) -> tuple[int, dict]:
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession() as session, session.request(method, url, headers=headers, data=data, timeout=timeout) as r:
        return r.status, json.loads(await r.text() or "{}")


async def _ended_meanwhile(agent: AgentClient, engine: str, launch: str, action: Awaitable[T]) -> tuple[dict, T]:
    """`ended`'s answer to a long-poll held open (as far as the loop lets us see) while `action` runs."""
    answer: dict = {}
    async with anyio.create_task_group() as tg:

        async def wait() -> None:
            answer.update(await agent.ended(engine, launch, 30))

        tg.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        result = await action
    return answer, result


async def test_every_route_needs_the_token(tmp_path):
    async with serving(stub_engines(tmp_path)) as (_, url):
        for method, route in [("GET", "/status"), ("POST", "/engines/engine-0/launch"), ("POST", "/engines/engine-0/stop"),
                              ("GET", "/engines/engine-0/ended?launch=x&wait_s=0"), ("GET", "/no/such/route")]:
            for headers in (None, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN},
                            {"Authorization": f"Basic {TOKEN}"}):
                status, body = await _raw(method, url + route, headers=headers)
                assert status == 401 and "agent.token" in body["error"], (method, route, headers, status, body)
        status, body = await _raw("GET", url + "/status", headers=AUTH)
        assert status == 200 and [e["name"] for e in body["engines"]] == ["engine-0"]
        assert body["engines"][0]["running"] is False and body["engines"][0]["launches"] == 0


async def test_a_token_header_that_is_not_utf8_is_a_401_like_any_wrong_token(tmp_path):
    """Raw bytes that are not UTF-8 (aiohttp's client would not send them) were a 500."""
    async with serving(stub_engines(tmp_path)) as (agent, _), await anyio.connect_tcp("127.0.0.1", agent.port) as stream:
        await stream.send(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer \xff\xfe\r\n"
                          b"Connection: close\r\n\r\n")
        answer = b""
        with anyio.fail_after(30):
            try:
                while True:
                    answer += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401 "), answer[:300]
    assert "agent.token" in json.loads(body)["error"]


async def test_bad_requests_get_a_400_that_says_what_and_the_agent_stays_up(tmp_path, weights):
    launch = "/engines/engine-0/launch"
    cases = [
        (launch, b"not json", "not JSON"),
        (launch, b"[1, 2]", "JSON object"),
        (launch, json.dumps({"version": 0}).encode(), "weights"),
        (launch, json.dumps({"weights": str(weights), "version": -1}).encode(), "version"),
        (launch, json.dumps({"weights": str(weights), "version": 0, "gpus": 8}).encode(), "gpus"),
        (launch, json.dumps({"weights": str(weights), "version": 0, "extra_args": ["--host=0.0.0.0"]}).encode(), "--host"),
        # vLLM's parser takes abbreviations and `_` for `-`: each of these set --host or --api-key.
        (launch, json.dumps({"weights": str(weights), "version": 0, "extra_args": ["--hos", "0.0.0.0"]}).encode(),
         "vLLM's --host, which the agent decides"),
        (launch, json.dumps({"weights": str(weights), "version": 0, "extra_args": ["--api_key=evil"]}).encode(),
         "vLLM's --api-key, which the agent decides"),
        (launch, json.dumps({"weights": str(weights), "version": 0, "extra_args": ["--api-ke", "evil"]}).encode(),
         "vLLM's --api-key, which the agent decides"),
        (launch, json.dumps({"weights": str(weights), "version": 0, "worker_extension": "os; rm"}).encode(), "dotted"),
        (launch, json.dumps({"weights": str(weights / "missing"), "version": 0}).encode(), "not a directory"),
    ]
    async with serving(stub_engines(tmp_path)) as (_, url):
        for route, data, expected in cases:
            status, body = await _raw("POST", url + route, headers=AUTH, data=data)
            assert status == 400 and expected in body["error"], (data, status, body)
        status, body = await _raw("POST", url + "/engines/engine-7/launch", headers=AUTH,
                                  data=json.dumps({"weights": str(weights), "version": 0}).encode())
        assert status == 404 and "engine-0" in body["error"] and "agent.engines" in body["error"]
        for query in ("", "?wait_s=1", "?launch=x&wait_s=abc", "?launch=x&wait_s=-1", "?launch=x&wait_s=1e9"):
            status, body = await _raw("GET", url + "/engines/engine-0/ended" + query, headers=AUTH)
            assert status == 400 and "wait_s" in body["error"], (query, body)
        status, body = await _raw("GET", url + "/status", headers=AUTH)
        assert status == 200 and body["engines"][0]["launches"] == 0, "nothing was launched by a bad request"


async def test_launch_hands_the_leader_url_and_token_status_and_stop(tmp_path, weights):
    engines = stub_engines(tmp_path, 2)
    async with serving(engines) as (_, url), AgentClient(url, TOKEN, 30) as agent:
        answer = await agent.launch("engine-1", LaunchRequest(weights=str(weights), version=4), timeout_s=60)
        assert not answer.adopted and answer.launches == 1 and answer.pid == engines[1].process.pid
        assert answer.url == engines[1].process.base_url and answer.model_names["full"][0] == "policy"
        # The leader talks to the engine directly, and the token proves which launch answers.
        async with aiohttp.ClientSession() as session, session.get(answer.url + "/health") as r:
            assert r.status == 200 and r.headers[LAUNCH_HEADER] == answer.launch_token
        status = await agent.status()
        one = {e["name"]: e for e in status["engines"]}["engine-1"]
        assert one["running"] and one["version"] == 4 and one["launch"] == answer.launch and one["handed"]
        assert one["url"] == answer.url and one["restarts"] == 0 and one["error"] is None
        assert not {e["name"]: e for e in status["engines"]}["engine-0"]["running"]
        # Memory, read on the agent's node: the running engine's whole process group; none for the other.
        group = sum(p.memory_info().rss for p in group_members(engines[1].process.pgid))
        assert 0.5 * group < one["memory"]["rss"] < 2 * group and one["memory"]["gpu"] is None, (one["memory"], group)
        assert {e["name"]: e for e in status["engines"]}["engine-0"]["memory"] is None
        assert status["rss"] > 10 * 2**20, "the agent's own resident bytes"

        ended = await agent.ended("engine-1", answer.launch, 0.05)
        assert ended["ended"] is False, "a running launch has not ended"
        pgid = engines[1].process.pgid
        waited, stopped = await _ended_meanwhile(agent, "engine-1", answer.launch, agent.stop("engine-1", timeout_s=60))
        assert stopped["stopped"] and waited["ended"] and waited["current"] is None
        assert group_members(pgid) == []
        status = await agent.status()
        assert not {e["name"]: e for e in status["engines"]}["engine-1"]["running"]


async def test_a_crashed_engine_is_relaunched_by_the_agent_and_handed_over_once(tmp_path, weights):
    [engine] = stub_engines(tmp_path, max_restarts=2)
    request = LaunchRequest(weights=str(weights), version=3, extra_args=["--seed", "1"])
    async with serving([engine]) as (_, url), AgentClient(url, TOKEN, 30) as agent:
        first = await agent.launch("engine-0", request, timeout_s=60)
        seen, _ = await _ended_meanwhile(agent, "engine-0", first.launch, crash(engine))
        assert seen["ended"] and seen["exit_code"] == -9, "the leader's watch hears the exit at once"

        with anyio.fail_after(30):
            while (await agent.status())["engines"][0]["launches"] < 2 or not engine.process.running:
                await anyio.sleep(0.05)
        relaunched = (await agent.status())["engines"][0]
        assert relaunched["restarts"] == 1 and not relaunched["handed"] and relaunched["weights"] == str(weights)

        other = LaunchRequest(weights=str(weights), version=3, extra_args=["--seed", "2"])
        adopted = await agent.launch("engine-0", request.model_copy(update={"version": 9}), timeout_s=60)
        assert adopted.adopted and adopted.launch == relaunched["launch"] and adopted.launches == 2
        assert adopted.launch_token != first.launch_token, "a new launch, a new token"
        again = await agent.launch("engine-0", request, timeout_s=60)
        assert not again.adopted and again.launches == 3, "a launch is handed over once"
        replaced = await agent.launch("engine-0", other, timeout_s=60)
        assert not replaced.adopted and replaced.launches == 4


async def test_a_spent_restart_budget_leaves_the_engine_down_with_the_reason(tmp_path, weights):
    [engine] = stub_engines(tmp_path, max_restarts=0)
    async with serving([engine]) as (_, url), AgentClient(url, TOKEN, 30) as agent:
        await agent.launch("engine-0", LaunchRequest(weights=str(weights), version=0), timeout_s=60)
        await crash(engine)
        with anyio.fail_after(30):
            while (status := (await agent.status())["engines"][0])["error"] is None:
                await anyio.sleep(0.05)
        assert not status["running"] and status["launches"] == 1
        assert "inference.max_restarts = 0" in status["error"]


async def test_a_failed_launch_is_a_502_with_the_reason(tmp_path, weights):
    [engine] = stub_engines(tmp_path)
    engine.process.stub_flags = ["--exit-code", "3"]
    async with serving([engine]) as (_, url), AgentClient(url, TOKEN, 30) as agent:
        with pytest.raises(AgentRequestError) as failed:
            await agent.launch("engine-0", LaunchRequest(weights=str(weights), version=0), timeout_s=60)
        assert failed.value.status == 502 and "exited with code 3" in failed.value.detail
        assert "no config.json" in failed.value.detail, "vLLM's log tail reaches the leader"
        status = (await agent.status())["engines"][0]
        assert status["error"].startswith("launch failed") and not status["running"]


async def test_stopping_the_agent_answers_the_watches_and_releases_the_engines(tmp_path, weights):
    [engine] = stub_engines(tmp_path)
    answer: dict = {}
    with anyio.fail_after(30):  # a held long-poll (60 s) does not hold the agent's stop
        async with anyio.create_task_group() as outside:
            async with serving([engine]) as (_, url):
                async with AgentClient(url, TOKEN, 30) as agent:
                    launched = await agent.launch("engine-0", LaunchRequest(weights=str(weights), version=0), timeout_s=60)
                pgid = engine.process.pgid

                async def watch() -> None:
                    async with AgentClient(url, TOKEN, 30) as leader:
                        answer.update(await leader.ended("engine-0", launched.launch, 60))

                outside.start_soon(watch)
                await anyio.wait_all_tasks_blocked()
    assert answer["ended"] and not engine.process.running and group_members(pgid) == []


async def test_a_restarted_agent_stops_the_engines_its_killed_predecessor_left_running(tmp_path, weights):
    """Agent engines outlive their launcher: an agent SIGKILLed (or OOM-killed) left its vLLM
    running, and the agent restarted on the same directory said it ended, answered `stop` with
    stopped, and never stopped it (its GPU held for good once no leader launched that engine
    again). The new agent stops it, by its launch record, before it answers anything."""
    from grpod.agent.hosted import HostedEngine

    [first] = stub_engines(tmp_path, outlives_launcher=True)
    killed = HostedEngine(first, "boot-1")
    await killed.launch(LaunchRequest(weights=str(weights), version=0), "127.0.0.1")
    pgid = first.process.pgid
    assert group_members(pgid), "the first agent's engine runs"
    # ...and that agent is gone without closing anything (as SIGKILL leaves it).
    [second] = stub_engines(tmp_path, outlives_launcher=True)
    with anyio.fail_after(30):
        async with serving([second]) as (_, url):
            assert group_members(pgid) == [], "stopped before the agent listened"
            async with AgentClient(url, TOKEN, 30) as agent:
                status = (await agent.status())["engines"][0]
    assert not status["running"]


async def test_a_stalled_engine_is_relaunched_by_the_agent_and_not_handed_over_though_it_answers_health(
    tmp_path, weights
):
    """An engine its watch found stalled still answers /health (vLLM's API server answers for a
    frozen core; tests/e2e/test_inference_process.py finds one on real vLLM): the agent's relaunch
    of a lost engine goes ahead, and the leader's launch does not adopt a stalled launch."""
    [engine] = stub_engines(tmp_path, max_restarts=2)
    request = LaunchRequest(weights=str(weights), version=3)
    async with serving([engine]) as (hosting, url), AgentClient(url, TOKEN, 30) as agent:
        [hosted] = hosting.engines
        await agent.launch("engine-0", request, timeout_s=60)
        engine.stalled = True  # what its watch sets on finding the stall
        assert await engine.healthy()
        await hosted.relaunch_lost(engine, "vLLM computed no token for 60 s with 8 requests in flight")
        relaunched = (await agent.status())["engines"][0]
        assert relaunched["launches"] == 2 and relaunched["restarts"] == 1 and not engine.stalled

        engine.stalled = True  # the agent's own relaunch stalls in turn
        answer = await agent.launch("engine-0", request, timeout_s=60)
        assert not answer.adopted and answer.launches == 3, "a stalled launch is not handed over"
