"""grpod's routes on vLLM's server, as data: their paths, the launch-token header, and the
translation between Atropos' `/generate` and vLLM's `/v1/completions`.

Nothing here imports vLLM or FastAPI: grpod's client and process supervisor use these names, and
`grpod.inference.server` (which runs inside vLLM's server process) serves them. See that module
for what each route does.
"""

from __future__ import annotations

from typing import Any

from grpod.inference.sampling import with_neutral_sampling

TOKEN_ID_PREFIX = "token_id:"
GENERATE_ROUTE = "/generate"
GENERATE_MODEL_ROUTE = "/grpod/generate_model"
PAUSE_ROUTE = "/grpod/pause"
RESUME_ROUTE = "/grpod/resume"
# vLLM's token-in / token-out route (served with --enable-scale-out): per-token weight versions.
TOKENS_GENERATE_ROUTE = "/inference/v1/generate"
UNGUARDED_ROUTES = frozenset({"/health"})
# The model name grpod serves the policy under (vLLM's --served-model-name, first of the names).
SERVED_MODEL_NAME = "policy"
LAUNCH_HEADER = "x-grpod-launch"
LAUNCH_TOKEN_ENV = "GRPOD_LAUNCH_TOKEN"
# Set for a CPU engine whose worker runs inside EngineCore: the server forks EngineCore
# (`grpod.inference.server._fork_engine_core`).
FORK_ENGINE_CORE_ENV = "GRPOD_FORK_ENGINE_CORE"


class GenerateRequestError(ValueError):
    """A `/generate` body that cannot be turned into a completion request."""


def completion_request_body(body: dict[str, Any], default_model: str | None = None) -> dict[str, Any]:
    """Translate an Atropos `/generate` body into a `/v1/completions` body (`default_model` when
    the body names no model).

    Token ids and their logprobs come back as ids (`return_token_ids`, `return_tokens_as_token_ids`)
    so that no detokenise/retokenise step can change them. Sampling parameters the body leaves out
    are stated neutral (`grpod.inference.sampling`); the environment's own values are kept.
    """
    if not isinstance(body, dict):
        raise GenerateRequestError("the body must be a JSON object")
    request = dict(body)
    if "prompt" not in request:
        raise GenerateRequestError('missing "prompt" (expected {"prompt": {"prompt_token_ids": [...]}})')
    prompt = request.pop("prompt")
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise GenerateRequestError('"prompt" is an object without "prompt_token_ids"')
        prompt = prompt["prompt_token_ids"]
    if request.pop("stream", False):
        raise GenerateRequestError("streaming is not supported on /generate; use /v1/completions")
    request["prompt"] = prompt
    request = with_neutral_sampling(request)
    if request.get("model") is None and default_model is not None:
        request["model"] = default_model
    request["return_token_ids"] = True
    request["return_tokens_as_token_ids"] = True
    return request


def _token_id(key: str) -> str:
    return key.removeprefix(TOKEN_ID_PREFIX)


def atropos_response(completion: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """Reshape a `/v1/completions` answer into the Atropos `/generate` answer for `request`."""
    choices = sorted(completion["choices"], key=lambda c: c["index"])
    answer: dict[str, Any] = {
        "text": [c["text"] for c in choices],
        "finish_reasons": [c["finish_reason"] for c in choices],
        "token_ids": [c["token_ids"] for c in choices],
        "prompt_token_ids": choices[0]["prompt_token_ids"] if choices else [],
    }
    if request.get("logprobs") is not None:
        answer["logprobs"] = [_output_logprobs(c) for c in choices]
    if request.get("prompt_logprobs") is not None:
        entries = choices[0]["prompt_logprobs"] if choices else []
        answer["prompt_logprobs"] = [
            None if entry is None else [{str(tok): lp["logprob"] for tok, lp in entry.items()}] for entry in entries
        ]
    return answer


def _output_logprobs(choice: dict[str, Any]) -> list[list[dict[str, float]]]:
    lps = choice["logprobs"]
    top = lps.get("top_logprobs") or []
    positions = []
    for i, (token, logprob) in enumerate(zip(choice["token_ids"], lps["token_logprobs"], strict=True)):
        entry = {str(token): logprob}
        for key, value in (top[i] if i < len(top) and top[i] else {}).items():
            entry.setdefault(_token_id(key), value)
        positions.append([entry])
    return positions
