"""`RemoteInference`: an engine that a `grpod agent` runs on another node, as the leader uses it.

The bridges and the `Policy` use it exactly like a local `SupervisedInference` (both are an
`InferenceEngine`: gate, lease, version, outstanding requests, restart budget, health watch); what
differs is where the process is:

- `launch` asks the agent (`POST /engines/{name}/launch`), which answers once vLLM is healthy with
  its base URL and launch token. The client then talks to vLLM directly and checks that token on
  every answer, so the leader knows it talks to the engine that launch started.
- `relaunch` is one launch request: the agent stops the current launch and starts a new one, or,
  when it already relaunched a crashed engine on the same weights and arguments by itself, hands
  that launch over instead of a second vLLM start (`phases` says which: `adopted`).
- `shutdown` asks the agent to stop the engine and wait until it released everything. An agent
  that cannot be reached is logged; its next launch request replaces what it runs.
- The watch cannot wait on a pidfd across machines: it holds a long-poll open on the agent
  (`GET /engines/{name}/ended`, answered the moment the launch ends), beside the same `/health`
  poll of the engine as a local one. An agent that does not answer is not a loss by itself: the
  engine's own `/health` decides (fault case 16, "agent unreachable for 30 s": training goes on,
  `ctl status` says the agent is unreachable and why, and the watch picks up again when it answers).
- `process` is a `RemoteProcess`: what the bridges read of a process (URL, token, pid on its
  node, whether it is believed to run, GPU or CPU), filled from the agent's answers.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import structlog

from grpod.agent.api import AgentClient, AgentRequestError, LaunchAnswer, LaunchRequest
from grpod.config import GrpodConfig, InferenceConfig
from grpod.inference.client import InferenceClient
from grpod.inference.engine import InferenceEngine
from grpod.inference.routes import SERVED_MODEL_NAME

log = structlog.get_logger(__name__)

T = TypeVar("T")
# Between attempts to reach an agent that did not answer (doubling from health_interval_s).
AGENT_RETRY_MAX_S = 5.0


class RemoteProcess:
    """What the bridges read of `engine.process` for an engine on an agent's node."""

    def __init__(self, cfg: InferenceConfig, *, gpu: bool, node: str) -> None:
        self.cfg = cfg
        self.gpu = gpu
        self.node = node
        self.pid: int | None = None
        self.running = False
        self.exit_code: int | None = None
        self.fixed_port = 0
        self.launch: str | None = None
        self.launch_token: str | None = None
        self._base_url: str | None = None
        self._model_names: dict[str, list[str]] = {}

    @property
    def base_url(self) -> str:
        if self._base_url is None:
            raise RuntimeError(f"the engine on {self.node} has no URL before its first launch")
        return self._base_url

    def client(self, timeout_s: float | None = None) -> InferenceClient:
        """A client of this launch (use it as `async with`): it accepts only answers with its token."""
        return InferenceClient(self.base_url, timeout_s or self.cfg.request_timeout_s, self.cfg.api_key,
                               launch_token=self.launch_token, generation_timeout_s=self.cfg.generation_timeout_s,
                               core_timeout_s=self.cfg.stall_timeout_s)

    def served_model_names(self, *, lora: bool = False) -> list[str]:
        return self._model_names.get("lora" if lora else "full") or [SERVED_MODEL_NAME]

    def launched(self, answer: LaunchAnswer) -> None:
        self._base_url, self.launch, self.launch_token = answer.url, answer.launch, answer.launch_token
        self.pid, self.gpu, self.fixed_port = answer.pid, answer.gpu, answer.fixed_port
        self._model_names = answer.model_names
        self.running, self.exit_code = True, None

    def ended(self, exit_code: int | None) -> None:
        self.running, self.exit_code = False, exit_code


class RemoteInference(InferenceEngine):
    """One engine of an agent (see the module docstring)."""

    def __init__(
        self, agent_url: str, token: str, cfg: InferenceConfig, *, engine: str, name: str, gpu: bool,
        request_timeout_s: float, watch_poll_s: float = 30.0,
    ) -> None:
        super().__init__(cfg, name=name)
        self.agent_url = agent_url
        self.agent_engine = engine
        self.node = agent_url
        self.process = RemoteProcess(cfg, gpu=gpu, node=agent_url)
        self._token = token
        self._request_timeout_s = request_timeout_s
        self._watch_poll_s = watch_poll_s  # the agent holds an `ended` request open this long
        self._asked = False  # a launch was asked for: shutdown has something to stop
        self.agent_seen: float | None = None  # monotonic time of the agent's last answer
        self.agent_error: str | None = None  # why the last request got no answer (None: it answered)

    def _agent(self) -> AgentClient:
        return AgentClient(self.agent_url, self._token, self._request_timeout_s)

    async def _contact(self, call: Awaitable[T]) -> T:
        """Await one agent request, recording whether the agent answered."""
        try:
            answer = await call
        except AgentRequestError as exc:
            if exc.status is None:
                self.agent_error = str(exc)
            else:
                self.agent_seen, self.agent_error = time.monotonic(), None
            raise
        self.agent_seen, self.agent_error = time.monotonic(), None
        return answer

    @property
    def _change_timeout_s(self) -> float:
        """A launch or stop at the agent may first wait for the agent's own relaunch (a stop and a
        start), then stop and start once more."""
        c = self.cfg
        return 2 * (c.start_timeout_s + c.stop_grace_s + 3 * c.release_timeout_s) + self._request_timeout_s

    # ---- lifecycle --------------------------------------------------------------------------
    async def launch(self, weights: Path, version: int, **launch_kwargs: Any) -> None:
        await self._serve(await self._ask_launch(weights, version, launch_kwargs), version, weights)

    async def relaunch(self, weights: Path, version: int, phases: dict[str, float] | None = None, **launch_kwargs: Any) -> None:
        """One launch request: the agent replaces the current launch, or hands over its own relaunch."""
        t = time.perf_counter()
        await self._close_client()
        self.process.ended(self.process.exit_code)
        answer = await self._ask_launch(weights, version, launch_kwargs)
        if phases is not None:
            phases["stop"] = answer.phases.get("stop_s", 0.0)
            phases["launch"] = time.perf_counter() - t - phases["stop"]
        await self._serve(answer, version, weights)

    async def _ask_launch(self, weights: Path, version: int, launch_kwargs: dict[str, Any]) -> LaunchAnswer:
        """The agent's launch; an agent that cannot be reached (restarting: systemd's RestartSec)
        is asked again, backing off, for up to `inference.start_timeout_s`."""
        request = LaunchRequest(weights=str(weights), version=version, **_plain(launch_kwargs))
        self._asked = True
        deadline = time.monotonic() + self._change_timeout_s
        unreachable_until = time.monotonic() + self.cfg.start_timeout_s
        delay = self.cfg.health_interval_s
        while True:
            try:
                async with self._agent() as agent:
                    left = max(deadline - time.monotonic(), 1.0)
                    return await self._contact(agent.launch(self.agent_engine, request, timeout_s=left))
            except AgentRequestError as exc:
                if exc.status is not None or time.monotonic() + delay >= min(deadline, unreachable_until):
                    raise
                log.warning("agent_unreachable", engine=self.name, agent=self.agent_url, error=str(exc)[:300],
                            note="the launch is asked again until its timeout")
            await anyio.sleep(delay)
            delay = min(delay * 2, AGENT_RETRY_MAX_S)

    async def _serve(self, answer: LaunchAnswer, version: int, weights: Path) -> None:
        """Take the agent's launch: its URL and token, then the client (which checks the token)."""
        self.process.launched(answer)
        await self._open_client(version, weights)
        log.info("remote_engine_launched", engine=self.name, url=answer.url, launch=answer.launch, pid=answer.pid,
                 adopted=answer.adopted, agent_phases=answer.phases)

    async def shutdown(self) -> None:
        """Close the gate and the client, ask the agent to stop the engine (bounded). A stop may
        take the agent minutes (`_change_timeout_s`), so the agent is first asked its status
        within `cluster.request_timeout_s`: a silent one (frozen, its node gone) is not waited for."""
        await self._close_client()
        if not self._asked:
            return
        with anyio.CancelScope(shield=True):
            try:
                async with self._agent() as agent:
                    await self._contact(agent.status())
                    answer = await self._contact(agent.stop(self.agent_engine, timeout_s=self._change_timeout_s))
                self.process.ended(answer.get("exit_code"))
                self._asked = False
            except AgentRequestError as exc:
                log.error("remote_engine_stop_failed", engine=self.name, agent=self.agent_url, error=str(exc),
                          note="the engine was not stopped: its agent stops it at its own shutdown")
                self.process.ended(None)

    # ---- the watch --------------------------------------------------------------------------
    async def _until_exited(self) -> str:
        """Return once the agent says this launch ended (long-polls; an unreachable agent is retried)."""
        launch = self.process.launch
        assert launch is not None
        delay = self.cfg.health_interval_s
        refused: set[int] = set()  # the error answers said so far (once each: the watch retries every few s)
        while True:
            silent = self.agent_error is not None  # `_contact` keeps whether the agent answered
            try:
                async with self._agent() as agent:
                    answer = await self._contact(agent.ended(self.agent_engine, launch, self._watch_poll_s))
            except AgentRequestError as exc:
                if exc.status == 404:  # restarted with fewer engines: this one is no more
                    return f"the agent at {self.agent_url} no longer serves {self.agent_engine}: {str(exc)[:200]}"
                if exc.status is None:
                    log.warning("agent_unreachable", engine=self.name, agent=self.agent_url, error=str(exc)[:300],
                                silent_s=round(time.monotonic() - self.agent_seen, 1) if self.agent_seen else None)
                elif exc.status not in refused:  # a rotated token (401), the agent's own error
                    refused.add(exc.status)
                    log.warning("agent_watch_refused", engine=self.name, agent=self.agent_url, status=exc.status,
                                error=str(exc)[:300], note="retried; /health still watches the engine")
                await anyio.sleep(delay)
                delay = min(delay * 2, AGENT_RETRY_MAX_S)
                continue
            if silent:
                log.info("agent_reachable", engine=self.name, agent=self.agent_url)
            delay = self.cfg.health_interval_s
            if not answer.get("ended"):
                continue
            if self.process.launch == launch:
                self.process.ended(answer.get("exit_code"))
            exited = f"vLLM on {self.agent_url} exited with code {answer.get('exit_code')}"
            if answer.get("current"):
                return f"{exited} and was relaunched by its agent (launch {answer['current']} replaced {launch})"
            return exited

    async def agent_status(self) -> dict[str, Any]:
        """The agent's `GET /status` (every engine it serves; AgentRequestError when it does not
        answer within `cluster.request_timeout_s`)."""
        async with self._agent() as agent:
            return await self._contact(agent.status())

    def describe(self) -> dict[str, Any]:
        age = round(time.monotonic() - self.agent_seen, 1) if self.agent_seen is not None else None
        contacted = self.agent_seen is not None or self.agent_error is not None
        return {
            **super().describe(),
            "launch": self.process.launch,
            "agent": {"url": self.agent_url, "engine": self.agent_engine,
                      "reachable": self.agent_error is None if contacted else None,  # None: not asked yet
                      "last_answer_age_s": age, "error": self.agent_error},
        }  # fmt: skip


async def agents_memory(engines: list[RemoteInference]) -> dict[str, dict[str, int | None]]:
    """What each of `engines` holds while it runs, as its agent reads it on its node (resident and
    GPU bytes of its process group): one `GET /status` per agent, whatever its engines. An agent
    that does not answer leaves its engines out (logged)."""
    by_agent: dict[str, list[RemoteInference]] = {}
    for engine in engines:
        by_agent.setdefault(engine.agent_url, []).append(engine)
    held = {}
    for url, served in by_agent.items():
        try:
            answer = await served[0].agent_status()
        except AgentRequestError as exc:
            log.warning("memory_read_failed", agent=url, error=str(exc))
            continue
        reported = {e.get("name"): e.get("memory") for e in answer.get("engines", [])}
        held |= {e.name: reported[e.agent_engine] for e in served if reported.get(e.agent_engine) is not None}
    return held


def _plain(value: Any) -> Any:
    """Launch arguments as JSON values (paths as strings)."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return str(value) if isinstance(value, Path) else value


def remote_engines(cfg: GrpodConfig, *, gpu: bool) -> list[RemoteInference]:
    """`cluster.engines_per_agent` engines of each agent of `cluster.agents`, named `<host:port>/engine-<i>`
    (ConfigError naming the key when the token file cannot be read). `gpu`: what the leader assumes
    of the agents' nodes until their first launch answers."""
    cluster = cfg.cluster
    if not cluster.agents:
        return []
    token = cluster.token_value()
    assert token is not None, "validated: cluster.agents needs a token"
    engines = []
    for url in cluster.agents:
        node = url.split("://", 1)[1]
        for index in range(cluster.engines_per_agent):
            engines.append(RemoteInference(
                url, token, cfg.inference, engine=f"engine-{index}", name=f"{node}/engine-{index}", gpu=gpu,
                request_timeout_s=cluster.request_timeout_s, watch_poll_s=cluster.watch_poll_s,
            ))  # fmt: skip
    return engines
