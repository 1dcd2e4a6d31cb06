"""`HostedEngine`: one engine a `grpod agent` supervises on its node for the leader.

The engine is a `SupervisedInference` (its own process group, launch token, release waits,
restart budget, pidfd and `/health` watch): the agent adds who may change it and what it tells
the leader.

Guarantees:
- One change at a time: launch, stop and the agent's own relaunch take the engine's lock, so a
  leader's request that arrives during a relaunch waits for it (bounded by that relaunch's own
  start and release timeouts) and then sees its outcome.
- A launch the leader asked for is handed to it (URL, launch token). A crashed engine is relaunched
  by the agent itself, on the weights and arguments the leader last launched it with, spending the
  agent's restart budget (`inference.max_restarts`); that launch is handed over at the leader's
  next launch request *for the same weights and arguments*, instead of a second vLLM start. A
  launch is handed over once: after that, a launch request replaces it (the leader's old copy may
  have changed its weights), so a leader never adopts an engine that served another leader.
- `wait_ended` answers as soon as a launch ends (process exit through a pidfd, stop, replacement,
  relaunch), or after its wait: the leader's watch of an engine it cannot see die.
- The agent signals only process groups its `InferenceProcess`es created.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import anyio
import structlog

from grpod.agent.api import LaunchAnswer, LaunchRequest
from grpod.inference.engine import InferenceEngine, RestartBudgetSpent
from grpod.inference.supervised import SupervisedInference
from grpod.service.race import first_of

log = structlog.get_logger(__name__)

# The version an engine reports in /status is asked of it with this bound (it answers in ms).
VERSION_QUERY_TIMEOUT_S = 2.0
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class EngineFailed(RuntimeError):
    """An engine could not be launched or stopped; the message says why (vLLM's log tail)."""


class HostedEngine:
    def __init__(self, engine: SupervisedInference, boot: str) -> None:
        """`boot`: this agent process's random tag; launch ids are `<boot>-<n>`, so a restarted
        agent never reuses the id of a launch a leader still holds."""
        self.engine = engine
        self.boot = boot
        self.request: LaunchRequest | None = None
        self.handed = False
        self.error: str | None = None
        self._lock = anyio.Lock()
        # Set when the current launch ends by the agent's hand (stop, replacement, relaunch).
        self._ended = anyio.Event()
        self._closing = False

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def launch_id(self) -> str | None:
        return f"{self.boot}-{self.engine.launches}" if self.engine.launches else None

    def url(self, request_host: str) -> str | None:
        """The engine's base URL as the leader reaches it: `inference.host`, or when that is a
        wildcard, the address the leader reached the agent at."""
        process = self.engine.process
        if process.port is None or not process.running:
            return None
        host = process.cfg.host if process.cfg.host not in WILDCARD_HOSTS else request_host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{process.port}"

    # ---- the leader's requests --------------------------------------------------------------
    async def launch(self, request: LaunchRequest, request_host: str) -> dict[str, Any]:
        """Launch the engine as asked (stopping the current launch first), or hand over the
        agent's own relaunch when it runs on the same weights and arguments."""
        async with self._lock:
            if self._adoptable(request) and not await self.engine.lost():
                self.request, self.handed = request, True
                log.info("engine_handed_over", engine=self.name, launch=self.launch_id, pid=self.engine.process.pid)
                return self._answer(request_host, adopted=True, phases={})
            t = time.perf_counter()
            await self._end_launch()
            stopped = time.perf_counter()
            self.request, self.error = request, None
            try:
                await self.engine.launch(request.weights, request.version, **request.launch_kwargs())
            except Exception as exc:
                self.error = f"launch failed: {exc}"
                raise EngineFailed(f"{self.name}: {exc}") from exc
            self.engine.open()  # the agent's /health watch runs while the gate is open
            self.handed = True
            phases = {"stop_s": round(stopped - t, 3), "launch_s": round(time.perf_counter() - stopped, 3)}
            return self._answer(request_host, adopted=False, phases=phases)

    async def stop(self) -> dict[str, Any]:
        """Stop the engine (it stays down: the agent relaunches only what crashed)."""
        async with self._lock:
            await self._end_launch()
            self.request = None
            return {"name": self.name, "stopped": True, "exit_code": self.engine.process.exit_code}

    def closing(self) -> None:
        """The agent is stopping: every `ended` long-poll answers now (this launch is ending)."""
        self._closing = True
        self._ended.set()

    async def close(self) -> None:
        """The agent's last word on this engine: stopped and released (after any change in flight)."""
        async with self._lock:
            try:
                await self._end_launch()
            except EngineFailed as exc:
                log.error("agent_engine_stop_failed", engine=self.name, error=str(exc))

    def _adoptable(self, request: LaunchRequest) -> bool:
        """The agent's own relaunch, never handed over, of what `request` asks for."""
        current = self.request
        return (
            not self.handed and current is not None and self.engine.client is not None
            and current.weights == request.weights and current.launch_kwargs() == request.launch_kwargs()
        )  # fmt: skip

    def _launch_ends(self) -> None:
        """Wake the `ended` long-polls of the current launch; nothing is handed over any more."""
        self._ended.set()
        self._ended = anyio.Event()
        self.handed = False

    async def _end_launch(self) -> None:
        self._launch_ends()
        try:
            await self.engine.shutdown()
        except Exception as exc:  # a release that timed out: the group may live on
            self.error = f"stop failed: {exc}"
            raise EngineFailed(f"{self.name}: {exc}") from exc

    # ---- the agent's own watch --------------------------------------------------------------
    async def relaunch_lost(self, engine: InferenceEngine, reason: str) -> None:
        """`SupervisedInference.watch`'s handler: relaunch a crashed or hung engine on the request
        it was last launched with; once the budget is spent, stop it and report why in /status."""
        async with self._lock:
            request = self.request
            if request is None or self.engine.client is None or not await self.engine.lost():
                return  # stopped, or replaced by a launch meanwhile
            try:
                self.engine.spend_restart(reason)
            except RestartBudgetSpent as exc:
                self.error = str(exc)
                log.error("engine_given_up", engine=self.name, error=str(exc))
                with contextlib.suppress(EngineFailed):  # its error is in /status
                    await self._end_launch()
                return
            log.warning("engine_lost", engine=self.name, pid=self.engine.process.pid, reason=reason,
                        restarts=self.engine.restarts)
            began = time.perf_counter()
            self._launch_ends()
            try:
                await self.engine.relaunch(request.weights, request.version, **request.launch_kwargs())
            except Exception as exc:  # noqa: BLE001 — reported in /status; the leader decides
                self.error = f"relaunch after a loss failed: {exc}"
                log.error("engine_relaunch_failed", engine=self.name, error=str(exc)[:500])
                return
            self.engine.open()
            log.info("engine_relaunched", engine=self.name, pid=self.engine.process.pid, launch=self.launch_id,
                     seconds=round(time.perf_counter() - began, 3))

    async def _exited(self) -> None:
        try:
            await self.engine.process.wait_exit()
        except RuntimeError:
            pass  # stopped meanwhile: wait_ended's loop sees it

    async def wait_ended(self, launch: str, wait_s: float) -> dict[str, Any]:
        """Return once `launch` is not the running launch any more, or after `wait_s`."""
        with anyio.move_on_after(wait_s):
            while self._running(launch):
                await first_of(self._ended.wait, self._exited)
        process = self.engine.process
        current = self.launch_id if self.launch_id != launch and process.running else None
        return {
            "name": self.name,
            "launch": launch,
            "ended": not self._running(launch),
            # Another launch that runs now (the agent's relaunch, or a leader's), if any.
            "current": current,
            "exit_code": process.exit_code,
        }

    def _running(self, launch: str) -> bool:
        return (
            not self._closing and launch == self.launch_id and self.engine.client is not None
            and self.engine.process.running
        )  # fmt: skip

    # ---- what the leader is told ------------------------------------------------------------
    def _answer(self, request_host: str, *, adopted: bool, phases: dict[str, float]) -> dict[str, Any]:
        process, client = self.engine.process, self.engine.client
        assert client is not None
        return LaunchAnswer(
            name=self.name,
            url=self.url(request_host),
            launch=self.launch_id,
            launch_token=client.launch_token,
            pid=process.pid,
            gpu=process.gpu,
            fixed_port=process.fixed_port,
            model_names={"full": process.served_model_names(), "lora": process.served_model_names(lora=True)},
            adopted=adopted,
            phases=phases,
            restarts=self.engine.restarts,
            launches=self.engine.launches,
        ).model_dump()

    async def status(self, request_host: str) -> dict[str, Any]:
        process, client = self.engine.process, self.engine.client
        version = self.engine.version
        if client is not None and process.running:
            try:
                with anyio.fail_after(VERSION_QUERY_TIMEOUT_S):
                    tag = await client.weight_version()
                version = int(tag) if tag is not None and str(tag).isdigit() else version
            except Exception as exc:  # noqa: BLE001 — a busy or dying engine: the last version known
                log.debug("engine_version_unanswered", engine=self.name, error=str(exc))
        return {
            "name": self.name,
            "url": self.url(request_host),
            "pid": process.pid,
            "running": process.running,
            "launch": self.launch_id if process.running else None,
            "handed": self.handed,
            "version": version,
            "weights": self.request.weights if self.request else None,
            "restarts": self.engine.restarts,
            "max_restarts": self.engine.cfg.max_restarts,
            "launches": self.engine.launches,
            "gpu": process.gpu,
            "error": self.error,
            "log": str(process.log_path),
        }
