"""InferenceClient's failure handling: every failure is one InferenceRequestError naming route,
status and body. A small aiohttp server plays the failures (vLLM's answers are covered in
tests/e2e/test_inference_process.py)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from grpod.inference.client import InferenceClient, InferenceRequestError
from grpod.inference.release import free_port

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"  # aiohttp's test server needs asyncio


@pytest.fixture
async def failing_server():
    seen: list[dict] = []

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append({"auth": request.headers.get("Authorization"), **body})
        if body.get("max_tokens") == 99:
            return web.json_response({"error": {"message": "max_tokens too large for this model"}}, status=400)
        if body.get("max_tokens") == 7:
            await asyncio.sleep(1)
        # One token id but two logprobs: a misaligned answer.
        choice = {"index": 0, "text": "a", "token_ids": [5], "logprobs": {"token_logprobs": [-1.0, -2.0]}}
        return web.json_response({"choices": [choice]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=503)

    async def lora(request: web.Request) -> web.Response:
        return web.Response(text="Success: LoRA adapter 'a' added successfully.")

    async def is_paused(request: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.json_response({"is_paused": False})

    async def pause(request: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.json_response({})

    async def weight_info(request: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.json_response({"weight_version": "1"})

    async def update_weight_version(request: web.Request) -> web.Response:  # vLLM started with another key
        return web.json_response({"error": "Unauthorized"}, status=401)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/load_lora_adapter", lora)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_post("/grpod/pause", pause)
    app.router.add_get("/weight_info", weight_info)
    app.router.add_post("/update_weight_version", update_weight_version)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port("127.0.0.1")
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}", seen
    finally:
        await runner.cleanup()


async def test_http_error_names_route_status_and_body(failing_server):
    url, seen = failing_server
    async with InferenceClient(url, 5.0, api_key="k") as client:
        with pytest.raises(InferenceRequestError) as err:
            await client.generate([1, 2], n=1, max_tokens=99, temperature=1.0)
    assert err.value.route == "/v1/completions" and err.value.status == 400
    assert "max_tokens too large" in str(err.value)
    assert seen[0]["auth"] == "Bearer k"
    assert seen[0]["logprobs"] == 0 and seen[0]["return_token_ids"] is True and seen[0]["prompt"] == [1, 2]
    # every sampling parameter the trainer does not replicate is stated neutral
    assert (seen[0]["top_k"], seen[0]["min_p"], seen[0]["repetition_penalty"]) == (0, 0.0, 1.0)
    assert (seen[0]["presence_penalty"], seen[0]["frequency_penalty"]) == (0.0, 0.0)


async def test_a_key_vllm_refuses_names_the_engine_and_the_setting(failing_server):
    url, _ = failing_server
    async with InferenceClient(url, 5.0, api_key="not-its-key") as client:
        with pytest.raises(InferenceRequestError) as err:
            await client._request("POST", "/update_weight_version", json_body={"version": "2"})
    assert err.value.status == 401
    assert url in str(err.value) and "inference.api_key" in str(err.value), str(err.value)


async def test_timeout_is_an_error_with_the_timeout_and_the_setting_that_bounds_it(failing_server):
    url, _ = failing_server
    async with InferenceClient(url, 5.0, generation_timeout_s=0.3) as client:
        with pytest.raises(InferenceRequestError, match=r"timed out after 0\.3 s \(inference\.generation_timeout_s\)") as err:
            await client.generate([1], n=1, max_tokens=7, temperature=1.0)
    assert err.value.status is None
    async with InferenceClient(url, 5.0, core_timeout_s=0.3) as client:
        # the questions the engine core answers between two steps
        for question in (client.is_paused(), client.pause("keep"), client.pause("abort")):
            with pytest.raises(InferenceRequestError, match=r"timed out after 0\.3 s \(inference\.stall_timeout_s\)"):
                await question
    async with InferenceClient(url, 0.3, generation_timeout_s=60.0, core_timeout_s=60.0) as client:
        with pytest.raises(InferenceRequestError, match=r"timed out after 0\.3 s \(inference\.request_timeout_s\)"):
            await client.weight_version()


async def test_misaligned_tokens_and_logprobs_are_refused(failing_server):
    url, _ = failing_server
    async with InferenceClient(url, 5.0) as client:
        with pytest.raises(InferenceRequestError, match="1 token ids but 2 logprobs"):
            await client.generate([1], n=1, max_tokens=2, temperature=1.0)


async def test_health_false_on_503_and_on_refused_connection(failing_server):
    url, _ = failing_server
    async with InferenceClient(url, 5.0) as client:
        assert await client.health() is False
    async with InferenceClient(f"http://127.0.0.1:{free_port('127.0.0.1')}", 5.0) as client:
        assert await client.health() is False
        with pytest.raises(InferenceRequestError, match="no response: ClientConnectorError"):
            await client.reset_prefix_cache()


async def test_plain_text_answers_are_accepted(failing_server):
    url, _ = failing_server
    async with InferenceClient(url, 5.0) as client:
        await client.load_lora_adapter("a", "/adapters/a")
