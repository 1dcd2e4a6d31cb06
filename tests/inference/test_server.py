"""grpod's additions to vLLM's server: the Atropos `/generate` shape and the all-routes key check.

The translation functions are checked on answers shaped as vLLM 0.32 gives them; the route and
middleware on a FastAPI app with vLLM's real middleware classes. `/generate` against a real
engine (and atroposlib's own client) is in tests/e2e/test_inference_process.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from argparse import Namespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from grpod.inference.routes import (
    GenerateRequestError,
    atropos_response,
    completion_request_body,
)
from grpod.inference.server import NAP_S, add_grpod_routes

ATROPOS_REQUEST = {"prompt": {"prompt_token_ids": [3, 4, 5]}, "logprobs": 0, "n": 2, "max_tokens": 2, "seed": 1}


def _completion(top_logprobs=None, prompt_logprobs=None) -> dict:
    """A /v1/completions answer as vLLM 0.32 dumps it (return_token_ids, token ids as logprob keys)."""
    return {
        "choices": [
            {
                "index": 1,
                "text": "zz",
                "finish_reason": "stop",
                "token_ids": [40, 2],
                "prompt_token_ids": [3, 4, 5],
                "logprobs": {"token_logprobs": [-0.5, -0.25], "top_logprobs": top_logprobs, "tokens": []},
                "prompt_logprobs": prompt_logprobs,
            },
            {
                "index": 0,
                "text": "ab",
                "finish_reason": "length",
                "token_ids": [27, 28],
                "prompt_token_ids": [3, 4, 5],
                "logprobs": {"token_logprobs": [-1.5, -2.5], "top_logprobs": top_logprobs, "tokens": []},
                "prompt_logprobs": prompt_logprobs,
            },
        ]
    }


def test_request_becomes_a_token_id_completion_request():
    body = completion_request_body(ATROPOS_REQUEST)
    assert body["prompt"] == [3, 4, 5]
    assert body["return_token_ids"] is True and body["return_tokens_as_token_ids"] is True
    sampling = {k: body[k] for k in ("logprobs", "n", "max_tokens", "seed")}
    assert sampling == {"logprobs": 0, "n": 2, "max_tokens": 2, "seed": 1}
    assert ATROPOS_REQUEST["prompt"] == {"prompt_token_ids": [3, 4, 5]}, "the caller's body must not change"


def test_unset_sampling_parameters_are_stated_neutral_and_the_environments_own_kept():
    body = completion_request_body(ATROPOS_REQUEST)
    assert {k: body[k] for k in ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "top_p")} == {
        "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "top_p": 1.0,
    }
    assert completion_request_body(ATROPOS_REQUEST | {"top_k": 5})["top_k"] == 5


def test_default_model_applies_only_when_the_request_names_none():
    assert completion_request_body(ATROPOS_REQUEST, "policy-v3")["model"] == "policy-v3"
    assert completion_request_body(ATROPOS_REQUEST | {"model": "policy"}, "policy-v3")["model"] == "policy"
    assert "model" not in completion_request_body(ATROPOS_REQUEST)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"n": 1}, 'missing "prompt"'),
        ({"prompt": {"ids": [1]}}, "without \"prompt_token_ids\""),
        ({"prompt": [1], "stream": True}, "streaming is not supported"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_requests_say_what_is_wrong(body, message):
    with pytest.raises(GenerateRequestError, match=message):
        completion_request_body(body)


def test_answer_in_the_shape_atropos_reads():
    answer = atropos_response(_completion(), ATROPOS_REQUEST)
    assert answer["text"] == ["ab", "zz"]
    assert answer["finish_reasons"] == ["length", "stop"]
    assert answer["token_ids"] == [[27, 28], [40, 2]]
    assert answer["prompt_token_ids"] == [3, 4, 5]
    assert answer["logprobs"] == [[[{"27": -1.5}], [{"28": -2.5}]], [[{"40": -0.5}], [{"2": -0.25}]]]
    assert "prompt_logprobs" not in answer
    # What atroposlib's VLLMServer does with it:
    ids = [[int(next(iter(item[0]))) for item in seq] for seq in answer["logprobs"]]
    lps = [[next(iter(item[0].values())) for item in seq] for seq in answer["logprobs"]]
    assert ids == answer["token_ids"] and lps == [[-1.5, -2.5], [-0.5, -0.25]]


def test_top_k_entries_follow_the_sampled_token():
    top = [{"token_id:27": -1.5, "token_id:9": -1.0}, {"token_id:7": -0.1, "token_id:28": -2.5}]
    answer = atropos_response(_completion(top_logprobs=top), ATROPOS_REQUEST | {"logprobs": 2})
    assert answer["logprobs"][0] == [[{"27": -1.5, "9": -1.0}], [{"28": -2.5, "7": -0.1}]]


def test_prompt_logprobs_when_asked():
    prompt_lps = [None, {4: {"logprob": -3.0, "rank": 2, "decoded_token": "1"}}, {5: {"logprob": -1.0, "rank": 1}}]
    request = {"prompt": {"prompt_token_ids": [3, 4, 5]}, "prompt_logprobs": 1}
    answer = atropos_response(_completion(prompt_logprobs=prompt_lps), request)
    assert answer["prompt_logprobs"] == [None, [{"4": -3.0}], [{"5": -1.0}]]
    assert "logprobs" not in answer


def _app(api_key: list[str] | None) -> TestClient:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.post("/pause")
    async def pause():
        return {"status": "paused"}

    add_grpod_routes(app, Namespace(api_key=api_key))
    return TestClient(app)


def test_key_guards_every_route_but_health(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    client = _app(["s3cret"])
    assert client.get("/health").status_code == 200
    assert client.post("/pause").status_code == 401
    assert client.post("/generate", json=ATROPOS_REQUEST).status_code == 401
    assert client.post("/pause", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.post("/pause", headers={"Authorization": "Bearer s3cret"}).json() == {"status": "paused"}


def test_key_from_environment_guards_too(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    client = _app(None)
    assert client.post("/pause").status_code == 401
    assert client.post("/pause", headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_no_key_no_check_and_bad_generate_body_is_400(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    client = _app(None)
    assert client.post("/pause").status_code == 200
    answer = client.post("/generate", json={"prompt": {"ids": [1]}})
    assert answer.status_code == 400 and "prompt_token_ids" in answer.json()["error"]["message"]
    assert client.post("/generate", content=b"not json").status_code == 400


def test_generate_model_route_sets_the_default(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    client = _app(None)
    assert client.post("/grpod/generate_model", json={"model": "policy-v2"}).json() == {"model": "policy-v2"}
    assert client.app.state.grpod_generate_model == "policy-v2"
    assert client.post("/grpod/generate_model", json={"model": None}).json() == {"model": None}
    assert client.app.state.grpod_generate_model is None
    assert client.post("/grpod/generate_model", json={"model": 3}).status_code == 400
    assert client.post("/grpod/generate_model", json={}).status_code == 400


def test_every_answer_carries_the_launch_token_401s_and_404s_included(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("GRPOD_LAUNCH_TOKEN", "launch-1")
    client = _app(["s3cret"])
    for answer in (client.get("/health"), client.post("/pause"), client.get("/nowhere")):
        assert answer.headers["x-grpod-launch"] == "launch-1", answer.status_code
    monkeypatch.delenv("GRPOD_LAUNCH_TOKEN")
    assert "x-grpod-launch" not in _app(None).get("/health").headers


def test_vllm_processes_nap_instead_of_spinning_on_cpu():
    """vLLM's spawned engine and worker import this module as `__mp_main__`; on CPU that import
    replaces the shared-memory queue's busy `sched_yield` with a NAP_S sleep."""
    code = textwrap.dedent(
        """
        import json, runpy, time
        naps = []
        time.sleep = naps.append
        runpy.run_module("grpod.inference.server", run_name="__mp_main__")
        from vllm.distributed.device_communicators import shm_broadcast
        from vllm.platforms import current_platform
        shm_broadcast.sched_yield()
        print(json.dumps({"cpu": current_platform.is_cpu(), "naps": naps}))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["naps"] == ([NAP_S] if seen["cpu"] else [])


def test_vllm_reads_the_refused_spellings_as_reserved_options_and_grpods_server_takes_none():
    """grpod.config's reading of a reserved option against vLLM's real parser: every vLLM option
    grpod reserves exists, each refused spelling sets it in vLLM's stock parser (abbreviated, `_`
    for `-`), no other vLLM option is refused, and grpod's server parser takes no abbreviation."""
    code = textwrap.dedent(
        """
        import json
        import vllm.entrypoints.launchers.cli_args as cli_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from grpod.config import RESERVED_VLLM_OPTIONS, reserved_vllm_option
        from grpod.inference.server import _options_in_full

        def parse(parser, extra):
            try:
                return vars(parser.parse_args(["--model", "m", *extra]))
            except SystemExit:
                return None

        stock = cli_args.make_arg_parser(FlexibleArgumentParser())
        options = {o for a in stock._actions for o in a.option_strings if o.startswith("--")}
        spellings = {"--hos": "host", "--api_ke": "api_key", "--api-k": "api_key", "--por": "port", "--ud": "uds",
                     "--served_model": "served_model_name"}
        _options_in_full()
        strict = cli_args.make_arg_parser(FlexibleArgumentParser())  # as vLLM's launcher looks it up
        print(json.dumps({
            "missing": sorted(set(RESERVED_VLLM_OPTIONS) - options),
            "refused": sorted(o for o in options if reserved_vllm_option(o) and o not in RESERVED_VLLM_OPTIONS),
            "stock": {s: reserved_vllm_option(s) and (parse(stock, [s, "7000"]) or {}).get(d) for s, d in spellings.items()},
            "strict": {s: parse(strict, [s, "7000"]) for s in spellings},
            "in_full": parse(strict, ["--host", "h", "--max-num-seqs", "2"])["host"],
        }))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["missing"] == [] and seen["refused"] == []
    assert all(value in ("7000", 7000, ["7000"]) for value in seen["stock"].values()), seen["stock"]
    assert seen["strict"] == dict.fromkeys(seen["strict"]) and seen["in_full"] == "h"
