"""`grpod agent`: the daemon of an inference node, serving its engines to the leader.

It reads the same TOML tree as `grpod start` (`[model]`, `[inference]`, `[run]`) plus `[agent]`,
builds `agent.engines` engines (`SupervisedInference`, each its own process group, port, log and
restart budget, CPU cores or GPU as `inference.engines` would spread them), and serves the API
of `grpod.agent.api` on `agent.host:agent.port`. Engines are launched only when the leader asks:
an agent alone runs nothing.

Guarantees:
- No route answers without `Authorization: Bearer <agent.token>` (compared in constant time);
  the agent refuses to start without a token (`agent.token` / `agent.token_file`). Engines on a
  routable `inference.host` need `inference.api_key` (`InferenceProcess` refuses otherwise).
- Nothing the leader sends can end the agent: a malformed request is a 400 naming what is wrong, a
  failure inside a handler a 500 with its message; the engines and the other routes carry on.
- Every wait is bounded: launches by `inference.start_timeout_s`, stops by the release timeouts,
  `ended` by its `wait_s` (at most `MAX_ENDED_WAIT_S`).
- On SIGTERM/SIGINT every engine is stopped and released before the agent exits; systemd hears
  READY=1 once the API listens and STOPPING=1 when it stops (`Type=notify`).

The task tree: `Agent.run` → task group { the API server, each engine's watch
(`SupervisedInference.watch` → `HostedEngine.relaunch_lost`), signals }.
"""

from __future__ import annotations

import hmac
import math
import os
import secrets
import signal
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import structlog
from aiohttp import web
from pydantic import ValidationError

from grpod.agent.api import (
    ENDED_ROUTE,
    LAUNCH_ROUTE,
    MAX_ENDED_WAIT_S,
    STATUS_ROUTE,
    STOP_ROUTE,
    LaunchRequest,
)
from grpod.agent.hosted import EngineFailed, HostedEngine
from grpod.config import ConfigError, GrpodConfig, InferenceConfig
from grpod.inference.memory import read_memory
from grpod.service.logs import LogLimit, configure_logging
from grpod.service.notify import SystemdNotifier
from grpod.inference import release
from grpod.inference.process import InferenceProcess, UnsafeBindError, engine_env
from grpod.inference.supervised import SupervisedInference

log = structlog.get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# On the way out, requests in flight get this long to finish before they are cancelled.
SHUTDOWN_GRACE_S = 5.0
# How long the launch route waits for the weights directory's filesystem to answer a stat.
STAT_TIMEOUT_S = 10.0


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def build_app(engines: list[HostedEngine], token: str) -> web.Application:
    """The API over `engines` (see `grpod.agent.api`), every route behind the bearer token."""
    by_name = {engine.name: engine for engine in engines}
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not _token_matches(request.headers.get("Authorization", ""), expected):
            log.warning("agent_unauthorized", peer=request.remote, path=request.path)
            return web.json_response(
                {"error": "missing or wrong token: send `Authorization: Bearer <agent.token>`"},
                status=401, headers={"WWW-Authenticate": "Bearer"},
            )
        try:
            return await handler(request)
        except web.HTTPException as exc:  # aiohttp's own (404 route, 405 method): as JSON
            return _error(exc.status, exc.reason)
        except Exception as exc:  # a handler's failure must not end the agent
            log.exception("agent_request_failed", path=request.path)
            return _error(500, f"{type(exc).__name__}: {exc}")

    def engine_of(request: web.Request) -> HostedEngine:
        name = request.match_info["name"]
        if name not in by_name:
            raise _NotFound(f"no engine {name!r} on this agent (it serves {', '.join(by_name)}: agent.engines)")
        return by_name[name]

    async def status(request: web.Request) -> web.Response:
        answers = [await engine.status(request.url.host or "127.0.0.1") for engine in engines]
        groups = {e.name: e.engine.process.pgid for e in engines if e.engine.process.running}
        gpu = any(e.engine.process.gpu for e in engines)
        reading = await anyio.to_thread.run_sync(partial(read_memory, groups, gpu=gpu))
        for answer in answers:  # each running engine's process group, read on this node
            answer["memory"] = reading.engines.get(answer["name"])
        return web.json_response({"node": socket.gethostname(), "pid": os.getpid(), "rss": reading.daemon_rss,
                                  "engines": answers})

    async def launch(request: web.Request) -> web.Response:
        try:
            engine = engine_of(request)
            body = await _json_body(request)
            launch_request = LaunchRequest.model_validate(body)
        except _NotFound as exc:
            return _error(404, str(exc))
        except (_BadRequest, ValidationError) as exc:
            return _error(400, _describe(exc))
        # In a worker thread: the weights live on a shared filesystem, and a hung NFS stat on the
        # event loop would hold every route, the leader's long-polls and the engines' watches.
        with anyio.move_on_after(STAT_TIMEOUT_S) as stat:
            is_dir = await anyio.to_thread.run_sync(Path(launch_request.weights).is_dir, abandon_on_cancel=True)
        if stat.cancelled_caught:
            return _error(503, f"weights {launch_request.weights!r}: its filesystem did not answer within "
                               f"{STAT_TIMEOUT_S:g} s on {socket.gethostname()}")
        if not is_dir:
            return _error(400, f"weights {launch_request.weights!r} is not a directory on {socket.gethostname()}")
        try:
            answer = await engine.launch(launch_request, request.url.host or "127.0.0.1")
        except EngineFailed as exc:
            return _error(502, str(exc))
        return web.json_response(answer)

    async def stop(request: web.Request) -> web.Response:
        try:
            engine = engine_of(request)
        except _NotFound as exc:
            return _error(404, str(exc))
        try:
            return web.json_response(await engine.stop())
        except EngineFailed as exc:
            return _error(502, str(exc))

    async def ended(request: web.Request) -> web.Response:
        try:
            engine = engine_of(request)
        except _NotFound as exc:
            return _error(404, str(exc))
        launch_id = request.query.get("launch", "")
        try:
            wait_s = float(request.query.get("wait_s", "0"))
        except ValueError:
            wait_s = math.nan
        if not launch_id or not 0 <= wait_s <= MAX_ENDED_WAIT_S:
            return _error(400, f"expected ?launch=<launch id>&wait_s=<0..{MAX_ENDED_WAIT_S:g}>")
        return web.json_response(await engine.wait_ended(launch_id, wait_s))

    app = web.Application(middlewares=[guard])
    app.router.add_get(STATUS_ROUTE, status)
    app.router.add_post(LAUNCH_ROUTE, launch)
    app.router.add_post(STOP_ROUTE, stop)
    app.router.add_get(ENDED_ROUTE, ended)
    return app


def _token_matches(given: str, expected: bytes) -> bool:
    """Whether the Authorization header is `expected`, compared in constant time. aiohttp keeps a
    header's bytes that are not UTF-8 as lone surrogates, which no token of ours encodes to."""
    try:
        raw = given.encode()
    except UnicodeEncodeError:
        return False
    return hmac.compare_digest(raw, expected)


class _NotFound(LookupError):
    pass


class _BadRequest(ValueError):
    pass


async def _json_body(request: web.Request) -> Any:
    try:
        body = await request.json()
    except ValueError as exc:
        raise _BadRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _BadRequest("the body must be a JSON object")
    return body


def _describe(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
    return str(exc)


# ---- the daemon ----------------------------------------------------------------------------


def agent_engines(cfg: GrpodConfig) -> list[SupervisedInference]:
    """This node's engines as `[agent]` and `[inference]` say (ConfigError naming the key)."""
    count = cfg.agent.engines or cfg.inference.engines
    if count < 1:
        raise ConfigError("agent.engines: the agent serves no engine (inference.engines = 0); set agent.engines >= 1")
    try:
        inference = InferenceConfig.model_validate(cfg.inference.model_dump() | {"engines": count})
    except ValidationError as exc:
        raise ConfigError(f"agent.engines = {count}: {exc.errors()[0]['msg']}") from None
    directory = cfg.agent_dir
    gpu = release.nvidia_gpu_count() > 0
    engines = []
    for index in range(count):
        try:
            process = InferenceProcess(inference, cfg.model, directory, gpu=gpu, index=index,
                                       env=engine_env(inference, index, gpu), outlives_launcher=True)
        except UnsafeBindError as exc:
            raise ConfigError(str(exc)) from None
        engines.append(SupervisedInference(process, inference, name=f"engine-{index}"))
    return engines


class Agent:
    """The daemon: the API server and every engine's watch in one task group, the engines stopped
    on every way out."""

    def __init__(self, engines: list[SupervisedInference], *, token: str, host: str, port: int,
                 logs: LogLimit | None = None) -> None:
        boot = secrets.token_hex(4)
        self.logs = logs  # the agent's directory: its grpod.log and its engines' logs
        self.engines = [HostedEngine(engine, boot) for engine in engines]
        self.token = token
        self.host = host
        self.port = port
        self.notifier = SystemdNotifier()

    async def serve(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """The API and the watches until cancelled. On the way out: the leader's long-polls are
        answered, requests in flight get `SHUTDOWN_GRACE_S` before they are cancelled (a launch's
        cancellation stops what it launched), then every engine is stopped and released."""
        # An agent killed before (SIGKILL, the OOM killer) left its engines running (they outlive
        # their launcher): stopped now, so that no leader sees them as ended while they hold the GPU.
        for hosted in self.engines:
            await hosted.engine.process.stop_left_behind()
        runner = web.AppRunner(build_app(self.engines, self.token), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
        await runner.setup()
        try:
            async with anyio.create_task_group() as tg:
                for hosted in self.engines:
                    tg.start_soon(hosted.engine.watch, hosted.relaunch_lost)
                if self.logs is not None:
                    tg.start_soon(self.logs.run)
                site = web.TCPSite(runner, self.host, self.port)
                await site.start()
                log.info("agent_listening", host=self.host, port=self.port, engines=[e.name for e in self.engines])
                task_status.started()
                await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                for hosted in self.engines:
                    hosted.closing()
                await runner.cleanup()
                for hosted in self.engines:
                    await hosted.close()

    async def run(self) -> int:
        log.info("agent_starting", pid=os.getpid(), host=self.host, port=self.port)
        async with anyio.create_task_group() as tg:
            await tg.start(self.serve)
            self.notifier.ready(f"listening on {self.host}:{self.port}, {len(self.engines)} engines")
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("agent_stopping", signal=signal.Signals(signum).name)
                    self.notifier.stopping(f"stopping on {signal.Signals(signum).name}")
                    break
            tg.cancel_scope.cancel()
        self.notifier.close()
        log.info("agent_stopped")
        return 0


def run_agent(cfg: GrpodConfig) -> int:
    """`grpod agent`: refuse to start without a token (ConfigError), else serve until signalled."""
    token = cfg.agent.token_value()
    if not token:
        raise ConfigError(
            "agent.token (or agent.token_file) is required: the agent's API launches and stops processes on "
            "this node; the leader sends the same secret as cluster.token"
        )
    engines = agent_engines(cfg)
    configure_logging(cfg.agent_dir, cfg.run.log_level)
    logs = LogLimit(cfg.agent_dir, cfg.run.log_max_bytes)
    return anyio.run(Agent(engines, token=token, host=cfg.agent.host, port=cfg.agent.port, logs=logs).run)
