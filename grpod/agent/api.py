"""The agent's HTTP API as data, and `AgentClient`, the leader's client of it.

Every route needs `Authorization: Bearer <agent.token>`; every answer is a JSON object, an error
one `{"error": "..."}` with its status (400 bad request, 401 no or wrong token, 404 no such
engine, 502 the engine failed to start or stop, 500 anything else: the agent stays up).

    GET  /status                           the agent (its resident bytes `rss`) and each engine
                                           (name, url, pid, running, version, restarts, launches,
                                           launch, memory: its process group's resident and GPU
                                           bytes while it runs, ...)
    POST /engines/{name}/launch            body `LaunchRequest`; answers once vLLM is healthy,
                                           with its base URL and launch token
    POST /engines/{name}/stop              stop it and wait until it released everything
    GET  /engines/{name}/ended?launch=ID&wait_s=S
                                           answers once launch ID ended (exit, stop, replacement)
                                           or after S seconds: the leader's watch of the engine

A launch answer carries the launch token the engine echoes on every answer: the leader's client
checks it, so the leader knows it talks to the engine this launch started, not to whatever took
its port.
"""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from grpod.config import refuse_reserved_vllm_options
from grpod.http import RequestError, SessionClient

STATUS_ROUTE = "/status"
LAUNCH_ROUTE = "/engines/{name}/launch"
STOP_ROUTE = "/engines/{name}/stop"
ENDED_ROUTE = "/engines/{name}/ended"
# The longest an `ended` request is held open before it answers "still running".
MAX_ENDED_WAIT_S = 60.0
# Error answers carry vLLM's log tail when a launch failed.
BODY_EXCERPT_CHARS = 3000

_DOTTED = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+$")


class LaunchRequest(BaseModel):
    """What the leader's bridge asks an engine to be launched with (`InferenceProcess.start`'s
    arguments), the weights being a path on the agent's node."""

    model_config = ConfigDict(extra="forbid")

    weights: str = Field(min_length=1)
    version: int = Field(ge=0)
    worker_extension: str | None = None
    extra_args: list[str] = []
    lora_modules: dict[str, str] | None = None
    enable_lora: bool = False
    max_lora_rank: int = Field(16, ge=1)
    lora_target_modules: list[str] | None = None

    @field_validator("worker_extension")
    @classmethod
    def _dotted(cls, value: str | None) -> str | None:
        if value is not None and not _DOTTED.match(value):
            raise ValueError(f"{value!r} is not a dotted class path like 'package.module.Class'")
        return value

    @field_validator("extra_args")
    @classmethod
    def _not_reserved(cls, args: list[str]) -> list[str]:
        # Where the engine listens and with what key are the agent's (its config's [inference]).
        return refuse_reserved_vllm_options(args, "the agent")

    def launch_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `InferenceProcess.start` (all but the weights)."""
        return self.model_dump(exclude={"weights", "version"})


class LaunchAnswer(BaseModel):
    """The agent's answer to a launch: where the engine answers and the token it echoes."""

    model_config = ConfigDict(extra="ignore")

    name: str
    url: str
    launch: str
    launch_token: str
    pid: int | None = None
    gpu: bool = False
    fixed_port: int = 0
    # The model names vLLM serves, full weights ("full") and in LoRA modes ("lora").
    model_names: dict[str, list[str]] = {}
    # True: the agent's own relaunch after a crash, handed over instead of a new launch.
    adopted: bool = False
    phases: dict[str, float] = {}
    restarts: int = 0
    launches: int = 0


class AgentRequestError(RequestError):
    """A request to an agent failed; `status` is None when no HTTP answer came back."""

    def __init__(self, url: str, route: str, status: int | None, detail: str) -> None:
        self.url = url
        super().__init__(route, status, detail)

    def where(self) -> str:
        return f"agent {self.url}"


class AgentClient(SessionClient):
    """The leader's client of one agent, over one aiohttp session: `async with AgentClient(...)`."""

    def __init__(self, url: str, token: str, timeout_s: float) -> None:
        super().__init__(token)
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    async def _request(
        self, method: str, route: str, *, json_body: dict | None = None, params: dict | None = None,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        if self._session is None:
            raise RuntimeError("AgentClient used outside `async with`")
        timeout = timeout_s if timeout_s is not None else self.timeout_s
        try:
            async with self._session.request(
                method, self.url + route, json=json_body, params=params,
                timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=self.timeout_s),
            ) as response:
                # Decoded leniently: a body that is not UTF-8 is a foreign service's, said below.
                status, text = response.status, (await response.read()).decode("utf-8", errors="replace")
        except TimeoutError:
            raise AgentRequestError(self.url, route, None, f"timed out after {timeout:g} s") from None
        except aiohttp.ClientError as exc:
            raise AgentRequestError(self.url, route, None, f"{type(exc).__name__}: {exc}") from None
        try:
            answer = json.loads(text) if text else {}
        except ValueError:
            # Another service on that address (a web server's HTML page, a proxy's error).
            raise AgentRequestError(self.url, route, status, f"not a grpod agent's answer (not JSON, "
                                    f"{response.content_type or 'no content type'}): {text[:BODY_EXCERPT_CHARS]}") from None
        if status != 200 or not isinstance(answer, dict):
            detail = answer.get("error") if isinstance(answer, dict) else None
            detail = detail if isinstance(detail, str) and detail else text  # a foreign {"error": {...}}
            raise AgentRequestError(self.url, route, status, detail[:BODY_EXCERPT_CHARS])
        return answer

    async def status(self) -> dict[str, Any]:
        return await self._request("GET", STATUS_ROUTE)

    async def launch(self, engine: str, request: LaunchRequest, *, timeout_s: float) -> LaunchAnswer:
        """Launch (or hand over the agent's own relaunch of) `engine`; answers once it is healthy."""
        route = LAUNCH_ROUTE.format(name=engine)
        answer = await self._request("POST", route, json_body=request.model_dump(), timeout_s=timeout_s)
        try:
            return LaunchAnswer.model_validate(answer)
        except ValidationError as exc:
            raise AgentRequestError(self.url, route, 200, f"malformed launch answer: {exc.errors()[0]['msg']}") from None

    async def stop(self, engine: str, *, timeout_s: float) -> dict[str, Any]:
        return await self._request("POST", STOP_ROUTE.format(name=engine), timeout_s=timeout_s)

    async def ended(self, engine: str, launch: str, wait_s: float) -> dict[str, Any]:
        """Whether `launch` of `engine` ended, waiting up to `wait_s` for it to end."""
        return await self._request(
            "GET", ENDED_ROUTE.format(name=engine), params={"launch": launch, "wait_s": f"{wait_s:g}"},
            timeout_s=wait_s + self.timeout_s,
        )
