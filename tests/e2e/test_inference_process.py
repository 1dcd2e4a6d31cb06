"""A real vLLM (CPU build) under InferenceProcess: generation, scoring, the dev routes, grpod's
Atropos `/generate` (with atroposlib's own client), start failures and a clean stop.

Most tests share the session's `vllm_server`; the stop and crash tests launch their own.
"""

from __future__ import annotations

import asyncio
import signal
import socket

import aiohttp
import anyio
import pytest
import structlog.testing

from grpod.inference.client import metric_totals
from grpod.config import InferenceConfig, ModelConfig
from grpod.inference.client import (
    ForeignServerError,
    InferenceClient,
    InferenceRequestError,
)
from grpod.inference.process import (
    InferenceProcess,
    InferenceStartError,
    PortInUseError,
)
from grpod.inference.release import group_members, port_is_free
from grpod.inference.routes import SERVED_MODEL_NAME
from grpod.inference.supervised import SupervisedInference
from tests.faults.injection import vllm_weights_holder
from tests.harness import start_decoy

pytestmark = [pytest.mark.e2e, pytest.mark.anyio]

PROMPT = [3, 4, 5, 6, 7, 8]


@pytest.fixture
def anyio_backend():
    return "asyncio"  # atroposlib and aiohttp need asyncio


async def test_generate_gives_n_completions_with_one_logprob_per_token(vllm_server):
    async with vllm_server.client() as client:
        completions = await client.generate(PROMPT, n=3, max_tokens=8, temperature=1.0, seed=11)
        again = await client.generate(PROMPT, n=3, max_tokens=8, temperature=1.0, seed=11)
    assert len(completions) == 3
    for c in completions:
        assert 1 <= len(c.token_ids) <= 8
        assert len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert c.finish_reason in ("stop", "length")
    assert again == completions, "a seeded request must repeat exactly"


# A generation long enough to outlast short timeouts: 64 completions of exactly 240 tokens
# (2.4 s on an idle 2-core machine with the tiny model; the model's context is 256).
LONG = {"n": 64, "max_tokens": 240, "min_tokens": 240, "temperature": 1.0}


async def test_a_generation_outlasting_the_request_timeout_is_not_cut(vllm_server):
    """A generation is bounded by inference.generation_timeout_s, not by the request timeout
    that bounds every other call: a healthy one takes as long as its tokens do."""
    request_timeout_s = 0.3
    async with vllm_server.client(request_timeout_s) as client:
        assert client.generation_timeout_s == vllm_server.cfg.generation_timeout_s > request_timeout_s
        before = await client.progress()
        started = anyio.current_time()
        completions = await client.generate(PROMPT, **LONG)
        took = anyio.current_time() - started
        after = await client.progress()
    assert took > request_timeout_s, f"the generation took {took:.2f} s: too short to show anything"
    assert [len(c.token_ids) for c in completions] == [LONG["max_tokens"]] * LONG["n"]
    assert after.tokens - before.tokens >= LONG["n"] * LONG["max_tokens"], (before, after)
    assert after.in_flight == 0


async def test_progress_counts_the_requests_a_generation_holds_in_flight(vllm_server):
    async with vllm_server.client() as client:
        seen = []

        async def read_while_generating(done: anyio.Event) -> None:
            while not done.is_set():
                seen.append(await client.progress())
                await anyio.sleep(0.05)

        done = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_while_generating, done)
            await client.generate(PROMPT, **LONG)
            done.set()
    assert max(p.in_flight for p in seen) == LONG["n"], seen
    assert len({p.tokens for p in seen if p.in_flight}) > 1, "the counters move while it generates"


STALL_S = 2.0


async def test_the_stall_watch_passes_long_generations_and_finds_a_frozen_engine_core(tmp_path, tiny_model_dir):
    """The engine's watch with inference.stall_timeout_s = 2: generations back to back for three
    times that are no stall; an engine core frozen (SIGSTOP) with a generation in flight is
    found by its token counters standing still, though /health answers all the while."""
    cfg = InferenceConfig(start_timeout_s=300.0, stall_timeout_s=STALL_S, stop_grace_s=2.0)
    engine = SupervisedInference(InferenceProcess(cfg, ModelConfig(path=tiny_model_dir), tmp_path / "run"), cfg)
    reasons: list[str] = []

    async def on_lost(lost, reason: str) -> None:
        reasons.append(reason)

    async def generate() -> None:
        async with engine.lease(SERVED_MODEL_NAME) as lease:
            await lease.client.generate(PROMPT, **LONG)

    await engine.launch(tiny_model_dir, version=0)
    try:
        engine.open()
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.watch, on_lost)
            started = anyio.current_time()
            while anyio.current_time() - started < 3 * STALL_S:
                await generate()
            assert reasons == [] and not engine.stalled, "a healthy generation was taken for a stall"

            core = vllm_weights_holder(engine.process.pgid)
            tg.start_soon(generate)
            with anyio.fail_after(60):
                while (await engine.client.progress()).in_flight == 0:
                    await anyio.sleep(0.02)
            core.suspend()  # a process of the group this test's engine launched
            frozen_at = anyio.current_time()
            try:
                with anyio.fail_after(4 * STALL_S + 30):
                    while not reasons:
                        await anyio.sleep(0.1)
                found_after = anyio.current_time() - frozen_at
                assert await engine.healthy(), "a frozen engine core still answers /health"
                assert engine.stalled and await engine.lost()
                assert engine.describe()["stalled"] is True
            finally:
                core.resume()
            tg.cancel_scope.cancel()
    finally:
        await engine.shutdown()
    # (The watch reports the loss again while nobody relaunches the engine: the first one is the stall.)
    assert "computed no token" in reasons[0] and "stall_timeout_s = 2" in reasons[0], reasons
    assert found_after >= STALL_S, f"found after {found_after:.1f} s, before the limit"


async def test_an_engine_that_keeps_no_token_counters_is_never_taken_for_stalled(tmp_path, tiny_model_dir):
    """vLLM run with --disable-log-stats publishes no counters: the stall watch says once that it
    cannot see, and long generations under a 1 s limit are no stall."""
    cfg = InferenceConfig(start_timeout_s=300.0, stall_timeout_s=1.0, extra_args=["--disable-log-stats"])
    engine = SupervisedInference(InferenceProcess(cfg, ModelConfig(path=tiny_model_dir), tmp_path / "run"), cfg)
    reasons: list[str] = []

    async def on_lost(lost, reason: str) -> None:
        reasons.append(reason)

    await engine.launch(tiny_model_dir, version=0)
    try:
        engine.open()
        with structlog.testing.capture_logs() as logs:
            async with anyio.create_task_group() as tg:
                tg.start_soon(engine.watch, on_lost)
                started = anyio.current_time()
                while anyio.current_time() - started < 3.0:
                    async with engine.lease(SERVED_MODEL_NAME) as lease:
                        await lease.client.generate(PROMPT, **LONG)
                tg.cancel_scope.cancel()
        with pytest.raises(InferenceRequestError, match="no token counter"):
            await engine.client.progress()
    finally:
        await engine.shutdown()
    assert reasons == [] and not engine.stalled
    blind = [e for e in logs if e["event"] == "stall_watch_blind"]
    assert len(blind) == 1 and "no token counter" in blind[0]["error"], blind


async def prefix_cache_tokens(client) -> dict[str, float]:
    """vLLM's prefix-cache counters: prompt tokens looked up ("queries") and found ("hits")."""
    totals = metric_totals(await client._request("GET", "/metrics"),
                            [f"vllm:prefix_cache_{name}_total" for name in ("queries", "hits")])
    return {name: totals[f"vllm:prefix_cache_{name}_total"] for name in ("queries", "hits")}


async def test_a_groups_completions_share_their_prompt_through_the_prefix_cache(vllm_server):
    """A group is n completions of one prompt. With the block grpod gives a CPU engine, every
    completion after the first reads the prompt's whole blocks from vLLM's prefix cache; with vLLM's
    CPU default (128-token blocks) a 40-token prompt fills no block and each completion computes it."""
    from grpod.inference.process import block_size_for

    block = block_size_for(vllm_server.cfg, gpu=False)
    prompt = [3 + (7 * i) % 40 for i in range(40)]  # used by no other test: nothing of it is cached yet
    async with vllm_server.client() as client:
        before = await prefix_cache_tokens(client)
        completions = await client.generate(prompt, n=4, max_tokens=4, temperature=1.0, seed=5)
        after = await prefix_cache_tokens(client)
    assert len(completions) == 4
    assert after["queries"] - before["queries"] >= 4 * (len(prompt) - 1)
    whole_blocks = (len(prompt) - 1) // block * block  # vLLM always computes the last prompt token
    assert whole_blocks > 0
    assert after["hits"] - before["hits"] >= 3 * whole_blocks, (before, after)


async def test_the_engine_runs_on_the_threads_it_is_given_while_it_serves(vllm_server):
    """`grpod_set_threads` (the worker extension every CPU engine gets) changes the thread count
    of the thread that runs the model, between requests, and sampling goes on unchanged."""
    from grpod.inference.cores import engine_threads

    own = engine_threads(vllm_server.cfg)
    async with vllm_server.client() as client:
        before = await client.generate(PROMPT, n=1, max_tokens=6, temperature=0.0)
        try:
            # vLLM's /collective_rpc answers each worker's result as a string.
            assert await client.collective_rpc("grpod_set_threads", args=[str(own + 1)]) == [str(own + 1)]
            assert [c.token_ids for c in await client.generate(PROMPT, n=1, max_tokens=6, temperature=0.0)] == [
                c.token_ids for c in before
            ]
        finally:
            assert await client.collective_rpc("grpod_set_threads", args=[str(own)]) == [str(own)], "the shared server restored"


async def test_the_real_server_echoes_its_launch_token_and_a_stranger_is_refused(vllm_server):
    async with vllm_server.client() as client:
        assert client.launch_token and await client.health()
    impostor = InferenceClient(vllm_server.base_url, 10.0, launch_token="not-this-launch")
    async with impostor:
        with pytest.raises(ForeignServerError, match="did not launch"):
            await impostor.health()


async def test_the_model_is_served_as_policy_and_by_its_path(vllm_server, tiny_model_dir):
    """Issue #16 item 7: an environment configured with the model's path reaches the policy."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{vllm_server.base_url}/v1/models") as response:
            served = {card["id"] for card in (await response.json())["data"]}
        assert {"policy", str(tiny_model_dir)} <= served
        body = {"model": str(tiny_model_dir), "prompt": PROMPT, "max_tokens": 4, "temperature": 0.0}
        async with session.post(f"{vllm_server.base_url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()


async def test_score_matches_sampled_logprobs_at_temperature_one(vllm_server):
    async with vllm_server.client() as client:
        (sample,) = await client.generate(PROMPT, n=1, max_tokens=6, temperature=1.0, seed=3)
        scores = await client.score(PROMPT + sample.token_ids)
        (cold,) = await client.generate(PROMPT, n=1, max_tokens=6, temperature=0.5, seed=3)
        cold_scores = await client.score(PROMPT + cold.token_ids)
    assert len(scores) == len(PROMPT) + len(sample.token_ids) - 1
    assert scores[len(PROMPT) - 1 :] == pytest.approx(sample.logprobs, abs=1e-4)
    # processed_logprobs: at T=0.5 vLLM reports logprobs of the sharpened distribution, not the
    # temperature-1 ones scoring gives.
    assert cold_scores[len(PROMPT) - 1 :] != pytest.approx(cold.logprobs, abs=1e-3)


async def test_a_request_stating_no_sampling_parameters_gets_plain_temperature_sampling(vllm_server):
    # The model's generation_config.json asks for top_k 3, min_p 0.2, a repetition penalty and
    # top_p 0.5 (conftest.HOSTILE_GENERATION_DEFAULTS). A bare request (as an environment might
    # send to /v1) must still be sampled at plain temperature 1: its processed logprobs equal the
    # full-vocabulary ones scoring gives, which those processors would have changed.
    url = f"{vllm_server.base_url}/v1/completions"
    body = {"model": "policy", "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "logprobs": 0,
            "return_token_ids": True, "seed": 5}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 200
        choice = (await response.json())["choices"][0]
    async with vllm_server.client() as client:
        scores = await client.score(PROMPT + choice["token_ids"])
    assert scores[len(PROMPT) - 1 :] == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-4)


async def test_dev_routes_pause_holds_requests_until_resume(vllm_server):
    async with vllm_server.client() as client:
        await client.pause("keep")
        try:
            assert await client.is_paused()
            results = []

            async def generate():
                results.append(await client.generate(PROMPT, n=1, max_tokens=4, temperature=1.0, seed=1))

            async with anyio.create_task_group() as tg:
                tg.start_soon(generate)
                await anyio.sleep(1.5)
                assert results == [], "a request completed while vLLM was paused"
                await client.resume()
                with anyio.fail_after(30):
                    while not results:
                        await anyio.sleep(0.05)
        finally:
            await client.resume()
        assert not await client.is_paused()
        assert len(results[0][0].token_ids) >= 1

        assert await client.reset_prefix_cache() is True
        await client.update_weight_version(7)
        assert await client.weight_version() == "7"

        # The fence as the bridges run it: grpod's pause, then reset + version + resume at once.
        await client.pause("keep")
        assert await client.is_paused()
        await client.end_fence(8)
        assert not await client.is_paused() and await client.weight_version() == "8"
        with pytest.raises(InferenceRequestError, match="HTTP 400.*mode must be"):
            await client._request("POST", "/grpod/pause", params={"mode": "wait"})
        with pytest.raises(InferenceRequestError, match="HTTP 400.*must be an integer"):
            await client._request("POST", "/grpod/resume", json_body={"version": "8"})
        assert not await client.is_paused() and await client.weight_version() == "8"
        inspection = await client.collective_rpc("get_model_inspection", timeout=30)
        assert len(inspection) == 1 and "Qwen2ForCausalLM" in inspection[0]


async def test_generate_route_matches_completions(vllm_server):
    request = {"prompt": {"prompt_token_ids": PROMPT}, "logprobs": 0, "n": 2, "max_tokens": 6}
    request |= {"temperature": 0.8, "top_p": 0.9, "seed": 21}
    async with aiohttp.ClientSession() as session:
        async with session.post(vllm_server.base_url + "/generate", json=request) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
    async with vllm_server.client() as client:
        expected = await client.generate(PROMPT, n=2, max_tokens=6, temperature=0.8, top_p=0.9, seed=21)
    assert answer["prompt_token_ids"] == PROMPT
    assert answer["token_ids"] == [c.token_ids for c in expected]
    assert answer["finish_reasons"] == [c.finish_reason for c in expected]
    assert answer["text"] == [c.text for c in expected]
    for seq, c in zip(answer["logprobs"], expected, strict=True):
        assert [list(pos[0]) for pos in seq] == [[str(t)] for t in c.token_ids]
        assert [next(iter(pos[0].values())) for pos in seq] == c.logprobs


async def test_generate_uses_the_default_model_when_the_request_names_none(vllm_server):
    request = {"prompt": {"prompt_token_ids": PROMPT}, "logprobs": 0, "max_tokens": 2}
    async with vllm_server.client() as client, aiohttp.ClientSession() as session:
        try:
            await client.set_generate_model("policy-v9")  # no such adapter is loaded
            async with session.post(vllm_server.base_url + "/generate", json=request) as response:
                assert response.status == 404 and "policy-v9" in await response.text()
            async with session.post(vllm_server.base_url + "/generate", json=request | {"model": "policy"}) as response:
                assert response.status == 200
        finally:
            await client.set_generate_model(None)
        async with session.post(vllm_server.base_url + "/generate", json=request) as response:
            assert response.status == 200


async def test_atroposlib_vllm_client_works_against_generate(vllm_server, tiny_model_dir):
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig
    from atroposlib.envs.server_handling.vllm_server import VLLMServer

    # The openai client it builds insists on a key; this server has none and ignores the header.
    config = APIServerConfig(
        base_url=vllm_server.base_url + "/v1", model_name=str(tiny_model_dir), api_key="unused", timeout=60
    )
    server = VLLMServer(config)
    try:
        prompt, tokens, logprobs, finish = await server.tokens_and_logprobs_completion(
            input_ids=PROMPT, n=2, max_tokens=5, temperature=1.0, seed=4
        )
        prompt_lps = await server.get_logprobs(input_ids=PROMPT + tokens[0])
        server.server_healthy = False
        with anyio.fail_after(10):
            while not server.server_healthy:  # its own /health poll brings it back
                await anyio.sleep(0.1)
    finally:
        if server.check_task is not None:
            server.check_task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await server.check_task
    async with vllm_server.client() as client:
        expected = await client.generate(PROMPT, n=2, max_tokens=5, temperature=1.0, seed=4)
        scores = await client.score(PROMPT + tokens[0])
    assert prompt == PROMPT
    assert tokens == [c.token_ids for c in expected]
    assert logprobs == [c.logprobs for c in expected]
    assert finish == [c.finish_reason for c in expected]
    assert prompt_lps["prompt_tokens"] == PROMPT + tokens[0]
    # Each position lists the actual token first, then the top-1 when that is another token.
    assert [ids[0] for ids in prompt_lps["prompt_topk_token_ids"][1:]] == (PROMPT + tokens[0])[1:]
    assert [lps[0] for lps in prompt_lps["prompt_topk_logprobs"][1:]] == pytest.approx(scores, abs=1e-4)


async def test_bad_model_path_fails_fast_with_log_tail_and_leaves_nothing(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    proc = InferenceProcess(InferenceConfig(start_timeout_s=240), ModelConfig(path=empty), tmp_path / "run")
    with pytest.raises(InferenceStartError, match="exited with code 1") as err:
        await proc.start(empty)
    assert "Invalid repository ID or local directory" in str(err.value)
    assert group_members(err.value.pgid) == []
    assert port_is_free("127.0.0.1", proc.port)
    assert not proc.running


async def test_fixed_port_in_use_is_refused(tmp_path, tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = InferenceProcess(InferenceConfig(port=port), ModelConfig(path=tiny_model_dir), tmp_path)
        with pytest.raises(PortInUseError, match=str(port)):
            await proc.start(tiny_model_dir)
    assert proc.pid is None


async def test_a_dead_engine_ends_the_server_and_stop_leaves_no_process_no_port_and_spares_the_decoy(
    tmp_path, tiny_model_dir
):
    """One launch: the process group holds EngineCore, and no Worker (one CPU engine runs its
    worker inside EngineCore, `inference.cpu_executor` "auto"); a SIGKILLed engine makes
    /health fail and the API server exit; stop then leaves no process of the group, the port
    free, and a decoy named like vLLM untouched. (A healthy server's stop: every bridge test ends
    with one, and so does the session server.)"""
    decoy = start_decoy(tmp_path)
    proc = InferenceProcess(InferenceConfig(start_timeout_s=300), ModelConfig(path=tiny_model_dir), tmp_path / "run")
    try:
        await proc.start(tiny_model_dir)
        pgid, port = proc.pgid, proc.port
        members = group_members(pgid)
        names = {" ".join(p.cmdline())[:40] for p in members}
        assert any("VLLM::EngineCore" in n for n in names) and not any("VLLM::Worker" in n for n in names), names
        (engine,) = [p for p in members if "VLLM::EngineCore" in " ".join(p.cmdline())]
        engine.send_signal(signal.SIGKILL)  # a member of the group this test's InferenceProcess created
        async with InferenceClient(proc.base_url, 5.0) as client:
            with anyio.fail_after(60):
                while await client.health():
                    await anyio.sleep(0.2)
        # vLLM shuts its API server down once the engine is gone (exit code 0, measured): the
        # supervisor's crash watch is the exit itself, whatever the code.
        with anyio.fail_after(60):
            await proc.wait_exit()
        assert not proc.running
        await proc.stop()
        assert group_members(pgid) == []
        assert port_is_free("127.0.0.1", port)
        assert not proc.running and proc.exit_code is not None
        assert decoy.poll() is None, "stop() touched a process outside its own group"
    finally:
        await proc.stop()
        decoy.kill()
        decoy.wait(timeout=10)


async def test_a_killed_api_server_leaves_its_port_refusing_while_the_orphaned_engine_lives(tmp_path, tiny_model_dir):
    """EngineCore is forked from the API server (one CPU engine) after vLLM bound the server's
    socket; the child must not keep listening on it. Killed, the API server's port refuses
    connections at once although the orphaned EngineCore still runs (grpod's requests fail fast and
    the bridge relaunches, instead of waiting out request_timeout_s on a backlog nobody reads)."""
    proc = InferenceProcess(InferenceConfig(start_timeout_s=300), ModelConfig(path=tiny_model_dir), tmp_path / "run")
    try:
        await proc.start(tiny_model_dir)
        pgid, port = proc.pgid, proc.port
        (engine,) = [p for p in group_members(pgid) if "VLLM::EngineCore" in " ".join(p.cmdline())]
        leader = [p for p in group_members(pgid) if p.pid == pgid][0]
        leader.send_signal(signal.SIGKILL)  # the group leader this test's InferenceProcess created
        # Its last threads take a moment to exit (0.5 s measured); a forked child holding the
        # socket or the event loop's io_uring would keep the port listening for good.
        with anyio.fail_after(30):
            while not port_is_free("127.0.0.1", port):
                await anyio.sleep(0.1)
        assert engine.is_running(), "the orphaned EngineCore outlives its API server"
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        await proc.stop()
    assert group_members(pgid) == []
