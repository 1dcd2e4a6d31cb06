"""`InferenceClient`: grpod's one HTTP client for the vLLM server it launched.

Covers what grpod needs from vLLM and nothing else: token-in/token-out generation with the
sampled tokens' logprobs, prompt scoring (the alignment probe), and the development routes the
weight bridges fence their updates with (pause / resume, prefix-cache reset, weight version,
collective RPC into the workers, runtime LoRA adapters). The dev routes exist only when the server
runs with `VLLM_SERVER_DEV_MODE=1`, which `InferenceProcess` sets.

Every call has a timeout; every failure (HTTP status, timeout, refused connection, malformed
answer) is one `InferenceRequestError` naming the route, the status and an excerpt of the body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import structlog
from prometheus_client.parser import text_string_to_metric_families

from grpod.http import RequestError, SessionClient
from grpod.inference.routes import (
    GENERATE_MODEL_ROUTE,
    LAUNCH_HEADER,
    PAUSE_ROUTE,
    RESUME_ROUTE,
    SERVED_MODEL_NAME,
    TOKENS_GENERATE_ROUTE,
)
from grpod.inference.sampling import NEUTRAL_SAMPLING

log = structlog.get_logger(__name__)

BODY_EXCERPT_CHARS = 500
PauseMode = Literal["keep", "wait", "abort"]
# vLLM's counters of the tokens its engine computed, and its gauges of the requests it holds.
TOKEN_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
REQUEST_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def metric_totals(text: str, names: list[str] | tuple[str, ...]) -> dict[str, float]:
    """Each named sample of a Prometheus text summed over its label sets (vLLM labels a metric per
    engine and model); 0.0 for a name the text lacks."""
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


@dataclass(frozen=True)
class EngineProgress:
    """What the engine says of its work (`/metrics`): the prompt and generated tokens it computed
    since launch, and the requests it runs or queues (as of its last engine step)."""

    tokens: float
    in_flight: int


def engine_progress(text: Any) -> EngineProgress:
    """`EngineProgress` from the text of vLLM's `/metrics`; ValueError when it is no Prometheus
    text or has no token counter (a server run with `--disable-log-stats` keeps none). Only the
    samples of these four metrics are parsed: the whole text (48 KB, 576 lines for one CPU engine)
    took 17-22 ms to parse, on the daemon's event loop."""
    if not isinstance(text, str):
        raise ValueError(f"not a Prometheus text: {str(text)[:200]}")
    samples = [line for line in text.splitlines() if line.startswith(TOKEN_COUNTERS + REQUEST_GAUGES)]
    if not any(line.startswith(TOKEN_COUNTERS) for line in samples):
        raise ValueError(f"no token counter ({', '.join(TOKEN_COUNTERS)})")
    totals = metric_totals("\n".join(samples) + "\n", TOKEN_COUNTERS + REQUEST_GAUGES)
    return EngineProgress(
        tokens=sum(totals[name] for name in TOKEN_COUNTERS),
        in_flight=round(sum(totals[name] for name in REQUEST_GAUGES)),
    )


class InferenceRequestError(RequestError):
    """A request to the vLLM server failed; `status` is None when no HTTP answer came back."""

    server = "vLLM"


class ForeignServerError(InferenceRequestError):
    """An answer without this launch's token: another process serves the port (never adopted)."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion: `logprobs[i]` is the logprob vLLM sampled `token_ids[i]` with."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    text: str
    # The policy version that sampled each id (`per_token_versions`); None: not reported.
    versions: list[int] | None = None


def token_versions(spans: list[dict[str, Any]] | None, count: int) -> list[int] | None:
    """One version per sampled id from vLLM's `weight_versions` spans (`{version, start, end}` over
    output-token indexes); None when the engine labelled none or the spans do not cover every id
    exactly once (the caller then falls back to the lease's version)."""
    if not spans:
        return None
    versions: list[int] = []
    for span in spans:
        if int(span["start"]) != len(versions) or int(span["end"]) < len(versions):
            return None
        versions += [int(span["version"])] * (int(span["end"]) - int(span["start"]))
    return versions if len(versions) == count else None


def _completion(choice: dict[str, Any], versioned: bool) -> Completion:
    ids = [int(t) for t in choice["token_ids"]]
    if versioned:  # the token-in/token-out route: chat-style logprob entries, and version spans
        logprobs = [float(entry["logprob"]) for entry in (choice["logprobs"] or {}).get("content") or []]
        versions = token_versions(choice.get("weight_versions"), len(ids))
    else:
        logprobs, versions = [float(lp) for lp in choice["logprobs"]["token_logprobs"]], None
    return Completion(token_ids=ids, logprobs=logprobs, finish_reason=choice.get("finish_reason"),
                      text=choice.get("text") or "", versions=versions)


def completions_of(route: str, answer: Any, n: int) -> list[Completion]:
    """The `n` completions of a generation's answer from `route`, in their order, each with one
    logprob per id; else the answer's error."""
    try:
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        completions = [_completion(c, route == TOKENS_GENERATE_ROUTE) for c in choices]
    except (KeyError, TypeError, ValueError) as exc:
        raise InferenceRequestError(route, 200, f"unexpected answer shape ({exc!r}): {str(answer)[:200]}") from None
    for c in completions:
        if len(c.token_ids) != len(c.logprobs):
            raise InferenceRequestError(
                route, 200, f"{len(c.token_ids)} token ids but {len(c.logprobs)} logprobs in one completion"
            )
    if len(completions) != n:
        raise InferenceRequestError(route, 200, f"asked for {n} completions, got {len(completions)}")
    return completions


class InferenceClient(SessionClient):
    """Async client over one aiohttp session; use as `async with InferenceClient(...) as client`."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float,
        api_key: str | None = None,
        *,
        launch_token: str | None = None,
        generation_timeout_s: float | None = None,
        core_timeout_s: float | None = None,
    ) -> None:
        """`launch_token`: the token the launched server echoes (`x-grpod-launch`); when given,
        every answer without it raises `ForeignServerError`. `generation_timeout_s` bounds a
        generation request, `core_timeout_s` a question the engine core answers between two of its
        steps (a pause that keeps or aborts, `/is_paused`), `timeout_s` every other (and these two
        when not given)."""
        super().__init__(api_key)
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.generation_timeout_s = generation_timeout_s or timeout_s
        self.core_timeout_s = core_timeout_s or timeout_s
        self.launch_token = launch_token

    async def _request(
        self,
        method: str,
        route: str,
        *,
        json_body: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
        setting: str = "inference.request_timeout_s",
    ) -> Any:
        """Send one request; return the decoded JSON body (the text when it is not JSON, None when
        empty).

        A request whose connection is reset or closed before any answer is sent once more on a
        new connection: the server may close an idle keep-alive connection just as a request is
        written to it (after a stall longer than its keep-alive timeout, every pooled connection
        is in that state). Every route grpod calls is safe to repeat. A dead server fails again.
        """
        if self._session is None:
            raise RuntimeError("InferenceClient used outside `async with`")
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        for attempt in (1, 2):
            try:
                async with self._session.request(
                    method,
                    self.base_url + route,
                    json=json_body,
                    params=params,
                    timeout=aiohttp.ClientTimeout(total=timeout),
                ) as response:
                    # Decoded leniently: a body that is not UTF-8 is a foreign server's (checked below).
                    text = (await response.read()).decode("utf-8", errors="replace")
                    status = response.status
                    is_json = response.content_type == "application/json"
                    echoed = response.headers.get(LAUNCH_HEADER)
                break
            except TimeoutError:
                raise InferenceRequestError(
                    route, None, f"timed out after {timeout:g} s ({setting})"
                ) from None
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if attempt == 2 or isinstance(exc, aiohttp.ClientConnectorError):
                    raise InferenceRequestError(route, None, f"{type(exc).__name__}: {exc}") from None
                log.info("inference_request_retried", route=route, error=f"{type(exc).__name__}: {exc}")
            except aiohttp.ClientError as exc:
                raise InferenceRequestError(route, None, f"{type(exc).__name__}: {exc}") from None
        if self.launch_token is not None and echoed != self.launch_token:
            raise ForeignServerError(
                route,
                status,
                f"the answer from {self.base_url} does not carry this launch's token "
                f"({'no' if echoed is None else 'another'} {LAUNCH_HEADER} header): "
                "the port is served by a process this grpod did not launch",
            )
        if status == 401:
            raise InferenceRequestError(
                route, status, f"{text[:BODY_EXCERPT_CHARS]} from {self.base_url}: its API key is not the one grpod "
                "sends (inference.api_key, or VLLM_API_KEY in inference.env; an agent's engines take the agent's)",
            )
        if status != 200:
            raise InferenceRequestError(route, status, text[:BODY_EXCERPT_CHARS])
        if not text:
            return None
        if not is_json:
            return text
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise InferenceRequestError(route, status, f"not JSON: {text[:BODY_EXCERPT_CHARS]}") from None

    async def health(self, *, timeout_s: float | None = None) -> bool:
        """True when /health answers 200 (vLLM answers 503 once its engine is dead).

        An answer from a server this client's launch did not start raises `ForeignServerError`."""
        try:
            await self._request("GET", "/health", timeout_s=timeout_s)
        except ForeignServerError:
            raise
        except InferenceRequestError:
            return False
        return True

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        seed: int | None = None,
        model: str = SERVED_MODEL_NAME,
        cache_salt: str | None = None,
        stop_token_ids: list[int] | None = None,
        per_token_versions: bool = False,
        min_tokens: int = 0,
    ) -> list[Completion]:
        """Sample `n` completions of a token-id prompt, each with one logprob per generated token
        (every other sampling parameter stated neutral: `grpod.inference.sampling`).

        `per_token_versions`: through vLLM's token-in/token-out route (`/inference/v1/generate`), which
        also reports which weight version sampled each id: a completion a weight update interrupts
        (the engine pauses between two tokens, takes the weights and resumes) says which of its ids
        each version sampled (`Completion.versions`). `min_tokens`: no end of sequence before that
        many ids (benchmarks and tests that need long generations; it changes the distribution)."""
        if per_token_versions:
            return await self._generate_versioned(
                prompt_ids, n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                model=model, cache_salt=cache_salt, stop_token_ids=stop_token_ids, min_tokens=min_tokens or None,
            )
        route = "/v1/completions"
        body: dict[str, Any] = {
            **NEUTRAL_SAMPLING,
            "model": model,
            "prompt": prompt_ids,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if stop_token_ids:
            body["stop_token_ids"] = stop_token_ids
        if min_tokens:
            body["min_tokens"] = min_tokens
        return await self._generation(route, body, n)

    async def _generate_versioned(
        self, prompt_ids: list[int], *, n: int, cache_salt: str | None, model: str, **sampling: Any
    ) -> list[Completion]:
        route = TOKENS_GENERATE_ROUTE
        params = {k: v for k, v in sampling.items() if v is not None}
        body: dict[str, Any] = {
            "token_ids": prompt_ids,
            "model": model,
            "output_mode": "text",
            "sampling_params": {**NEUTRAL_SAMPLING, **params, "n": n, "logprobs": 0},
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return await self._generation(route, body, n)

    async def _generation(self, route: str, body: dict[str, Any], n: int) -> list[Completion]:
        """A generation request: bounded by `generation_timeout_s`, not by the request timeout (a
        healthy generation takes as long as its tokens do; the engine's stall watch finds one that
        stopped generating)."""
        answer = await self._request("POST", route, json_body=body, timeout_s=self.generation_timeout_s,
                                     setting="inference.generation_timeout_s")
        return completions_of(route, answer, n)

    async def progress(self) -> EngineProgress:
        """The engine's token counters and requests in flight, from its `/metrics`."""
        text = await self._request("GET", "/metrics")
        try:
            return engine_progress(text)
        except ValueError as exc:
            raise InferenceRequestError("/metrics", 200, str(exc)) from None

    async def score(self, token_ids: list[int], *, model: str = SERVED_MODEL_NAME, cache_salt: str | None = None) -> list[float]:
        """Logprob of `token_ids[t]` given `token_ids[:t]` for t = 1..n-1, at temperature 1."""
        return (await self.score_many([token_ids], model=model, cache_salt=cache_salt))[0]

    async def score_many(
        self, sequences: list[list[int]], *, model: str = SERVED_MODEL_NAME, cache_salt: str | None = None
    ) -> list[list[float]]:
        """`score` of each sequence, in one request (vLLM runs them as one batch)."""
        route = "/v1/completions"
        body: dict[str, Any] = {
            **NEUTRAL_SAMPLING,
            "model": model,
            "prompt": sequences,
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        answer = await self._request("POST", route, json_body=body)
        try:
            choices = sorted(answer["choices"], key=lambda c: c["index"])
            if len(choices) != len(sequences):
                raise ValueError(f"{len(choices)} choices for {len(sequences)} prompts")
            return [
                [float(entries[t][str(ids[t])]["logprob"]) for t in range(1, len(ids))]
                for ids, entries in zip(sequences, (c["prompt_logprobs"] for c in choices), strict=True)
            ]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise InferenceRequestError(route, 200, f"unexpected prompt_logprobs shape ({exc!r})") from None

    async def pause(self, mode: PauseMode = "keep") -> None:
        """Stop scheduling: `keep` freezes in-flight requests until `resume`, `wait` drains them,
        `abort` cancels them. `keep` and `abort` go to grpod's `/grpod/pause` (the same engine
        pause as vLLM's `/pause` without its fixed 20 ms sleep), answered by the core between two
        steps (bounded by `core_timeout_s`); `wait` to vLLM's."""
        if mode == "wait":
            await self._request("POST", "/pause", params={"mode": mode})
        else:
            await self._core_question("POST", PAUSE_ROUTE, params={"mode": mode})

    async def resume(self) -> None:
        await self._request("POST", "/resume")

    async def end_fence(self, version: int) -> None:
        """After a weight change under `pause`: prefix-cache reset, weight version `version`,
        resume — one request to grpod's `/grpod/resume`."""
        await self._request("POST", RESUME_ROUTE, json_body={"version": version})

    async def is_paused(self) -> bool:
        """Whether the engine's scheduler is paused: answered by the engine core itself (the API
        server answers /health alone)."""
        answer = await self._core_question("GET", "/is_paused")
        return bool(answer["is_paused"])

    async def _core_question(self, method: str, route: str, **kwargs: Any) -> Any:
        return await self._request(method, route, timeout_s=self.core_timeout_s,
                                   setting="inference.stall_timeout_s", **kwargs)

    async def reset_prefix_cache(self, *, reset_running_requests: bool = False) -> bool:
        """Drop cached prefixes (needed after every weight change). False while blocks are still
        held by running requests; vLLM leaves the retry to the caller."""
        params = {"reset_running_requests": "true"} if reset_running_requests else None
        answer = await self._request("POST", "/reset_prefix_cache", params=params)
        return bool(answer["success"])

    async def update_weight_version(self, version: int) -> None:
        """Tag the weights vLLM serves from now on (vLLM stores it as a string)."""
        await self._request("POST", "/update_weight_version", json_body={"new_version": str(version)})

    async def weight_version(self) -> str | None:
        """The tag last set by `update_weight_version` (None before the first)."""
        answer = await self._request("GET", "/weight_info")
        return answer["weight_version"]

    async def collective_rpc(
        self,
        method: str,
        args: tuple[str, ...] | list[str] = (),
        kwargs: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Call `method` on every worker (vLLM passes only string arguments); one result each.

        `timeout` bounds the call inside vLLM; the HTTP request waits that long plus its own timeout.
        """
        body: dict[str, Any] = {"method": method, "args": list(args), "kwargs": kwargs or {}}
        http_timeout = self.timeout_s
        if timeout is not None:
            body["timeout"] = timeout
            http_timeout += timeout
        answer = await self._request("POST", "/collective_rpc", json_body=body, timeout_s=http_timeout)
        return [] if answer is None else list(answer["results"])

    async def load_lora_adapter(self, name: str, path: str, load_inplace: bool = False) -> None:
        """Load an adapter from `path` under `name`; reusing a name needs `load_inplace=True`."""
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": load_inplace}
        await self._request("POST", "/v1/load_lora_adapter", json_body=body)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._request("POST", "/v1/unload_lora_adapter", json_body={"lora_name": name})

    async def set_generate_model(self, model: str | None) -> None:
        """Make `/generate` requests that name no model (Atropos environments) use `model`, e.g.
        the current LoRA adapter; None restores the base model."""
        await self._request("POST", GENERATE_MODEL_ROUTE, json_body={"model": model})
