"""`OpenEnvAdapter`: OpenEnv environments as grpod episodes (`source.environment.adapter = "openenv"`).

Where the environment runs:
- `url` set: an OpenEnv server you started (any of OpenEnv's servers: `create_app` / `create_fastapi_app`
  behind uvicorn, a container, a Space); grpod starts nothing, and waits for its `/health` at entry.
- `name` set ("package.module:Class" or "path/to/file.py:Class", an OpenEnv `Environment` subclass
  built with `args`): grpod serves that class itself with OpenEnv's own app
  (`openenv.core.env_server.create_fastapi_app`, uvicorn) in a child process:
  `python -m grpod.rollouts.openenv_adapter serve NAME --fd N` (`--port P` serves it on a port of
  your choosing, for `url`). The child runs in a process group of its own, dies with the daemon
  (PR_SET_PDEATHSIG) and writes its output to `<run>/environment.log`. It listens on a socket
  the adapter binds once on 127.0.0.1 (a free port) and passes to every launch, so the URL stays
  the same across restarts and no other process can take the port in between (while no server
  runs, a connection waits in that socket's backlog: an `open` racing a death times out rather than
  being refused). Entry returns once
  `/health` answers (within `start_timeout_s`); a server that died is relaunched by the next `open`
  (which waits for it; `health()` gives its `state`, and `restarts` counts relaunches; a relaunch
  serves every episode, so a cancelled caller does not stop it). A call that timed out is
  abandoned: its group drops, its connection is closed, and the other episodes on the server play
  on, while the stuck step keeps a session and a thread of the server until it returns. The server
  is killed (SIGKILL; the next `open` relaunches it) at the `STUCK_LIMIT`-th stuck call of a launch,
  or at the first when it runs one session's step at a time (one session, or OpenEnv's
  `REQUIRES_SINGLE_THREAD_EXECUTOR`: that one stuck step would block every episode; the server
  says which on grpod's own route, `SESSIONS_ROUTE`, the one its start-up waits for);
  `health()["stuck"]` counts them. Leaving the adapter stops the group (SIGTERM, `STOP_GRACE_S`, SIGKILL),
  also when cancelled. `cfg.path` directories go first on the child's import path. The class is
  served with up to `MAX_SESSIONS` concurrent episodes when it declares
  `SUPPORTS_CONCURRENT_SESSIONS = True` (OpenEnv refuses more than one otherwise: mark your class
  if its instances share no state); the route says how many (`session_capacity`), and a run that
  plays more episodes at once is refused at start.

An episode is one session on OpenEnv's WebSocket endpoint (`/ws`), through OpenEnv's own client
(`openenv.core.generic_client.GenericEnvClient`: `reset`, `step`, `close`):
- `open(index, split)` resets with `seed = task_seed(cfg.task_seed, split, index)` (and an
  `episode_id`), so every episode of a task gets the same task;
- observation -> messages: an observation whose `messages` field is a list of chat messages
  (`{"role", "content"}` dicts) gives those messages; otherwise its `prompt` string gives one
  `user` message. The reset observation gives the opening messages, each step's the reply to the
  model's turn (roles `user` or `tool`). Any other observation is an `environment_error`;
- model turn -> action: the turn's text goes into the action's `message` field (OpenEnv's echo
  and TextArena actions call it so) or, if the action has no such field, into its only required
  string field (read from the server's `/schema` at entry);
- a step whose observation is `done` ends the episode (`respond` returns None); the episode's
  reward is the sum of the rewards of its steps (None counts as 0): OpenEnv rewards each step.

Failures (`EnvironmentFailure`, messages name the environment, the task and the turn): a call
longer than `timeout_s` is `environment_timeout`; a refused, reset or closed connection (the
server died) is `environment_crash`; an error the server answered (the environment raised, an
action it refused, a malformed observation) is `environment_error`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import typing
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import structlog

from grpod.config import EnvironmentConfig
from grpod.inference import release
from grpod.inference.process import LaunchLog, exit_code_of
from grpod.rollouts.chat_turns import Message
from grpod.rollouts.environments import EnvironmentFailure, EnvironmentTimeout, Split, checked_reply, finite_number
from grpod.service.children import cap_memory, die_with_parent, parent_env

log = structlog.get_logger(__name__)

# Between start-up health probes: until uvicorn serves, a probe waits in the listening socket's
# backlog and is answered as soon as it does.
STARTUP_POLL_S = 0.1
HEALTH_PROBE_TIMEOUT_S = 5.0
# SIGTERM to SIGKILL when the adapter stops its server; uvicorn itself is told to close open
# sessions within UVICORN_GRACE_S.
STOP_GRACE_S = 5.0
UVICORN_GRACE_S = 2
KILL_WAIT_S = 10.0
# A server that dropped a connection is given this long to be seen exited (`wait_dying`).
DYING_WAIT_S = 1.0
# Concurrent sessions a server grpod starts allows, for a class that supports several.
MAX_SESSIONS = 1024
# Calls left stuck on one launch of a server that serves several sessions before it is killed: each
# holds a session and a thread of the server (a spinning one, a core) until its step returns.
STUCK_LIMIT = 4
# How long the client of an abandoned (stuck) session is given to close its connection.
ABANDON_CLOSE_S = 2.0
# grpod's own route on a server it starts: how many sessions' steps it runs at once (1 for a class
# that serves one session, or that has OpenEnv run every session on one thread).
SESSIONS_ROUTE = "/grpod/sessions"


def task_seed(seed: int, split: Split, index: int) -> int:
    """The reset seed of task `index` of `split`: a function of (source.environment.task_seed,
    split, index) alone, in OpenEnv's range (a non-negative int, 32 bits)."""
    return random.Random(f"{seed}:{split}:{index}").getrandbits(32)


def step_reward(reward: Any, where: str) -> float:
    """A step's reward: a finite number, or None (OpenEnv's "no reward"; it also writes a NaN as
    null) for 0; else the environment's error."""
    if reward is None:
        return 0.0
    value = None if isinstance(reward, bool) else finite_number(reward)  # JSON's true is no reward of OpenEnv's
    if value is None:
        raise EnvironmentFailure("environment_error", f"{where}: its reward is {reward!r:.60}, expected a finite number")
    return value


def observation_messages(observation: Any, where: str) -> list[Message]:
    """The chat messages an observation stands for (module docstring)."""
    if not isinstance(observation, dict):
        raise EnvironmentFailure("environment_error", f"{where}: its observation is {type(observation).__name__} "
                                 f"{observation!r:.80}, expected an object")
    messages = observation.get("messages")
    if isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    prompt = observation.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    raise EnvironmentFailure(
        "environment_error",
        f"{where}: its observation has neither `messages` (a list of chat messages) nor `prompt` (a string); "
        f"its fields: {sorted(observation)}",
    )


def action_field(schema: dict[str, Any]) -> str:
    """The field of the action (its JSON schema) that takes the model's text (module docstring)."""
    properties = schema.get("properties", {})
    if "message" in properties:
        return "message"
    strings = [
        name for name in schema.get("required", []) if properties.get(name, {}).get("type") == "string"
    ]
    if len(strings) != 1:
        raise ValueError(
            f"the environment's action has no `message` field and {len(strings)} required string fields "
            f"({', '.join(strings) or 'none'}): grpod cannot tell which one takes the model's text; "
            f"name it `message`. Action fields: {sorted(properties)}"
        )
    return strings[0]


def _client_api() -> tuple[type, tuple[type[BaseException], ...]]:
    """OpenEnv's WebSocket client and the exceptions that mean "the connection is gone" (an
    optional dependency, imported when an adapter starts: importing it takes seconds)."""
    try:
        from openenv.core.generic_client import GenericEnvClient
        from websockets.exceptions import WebSocketException
    except ImportError as exc:
        raise RuntimeError(
            f"source.environment.adapter = 'openenv' needs openenv-core: pip install 'grpod[openenv]' ({exc})"
        ) from exc
    return GenericEnvClient, (OSError, EOFError, WebSocketException)


async def _get_json(url: str, timeout_s: float) -> Any:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.get(url) as response:
            response.raise_for_status()
            return await response.json()


async def wait_healthy(url: str, timeout_s: float, exited: Callable[[], str | None], route: str = "/health") -> Any:
    """The answer of `url + route` once it answers; RuntimeError after `timeout_s` or once
    `exited()` says why the server is gone."""
    with anyio.move_on_after(timeout_s):
        while True:
            gone = exited()
            if gone is not None:
                raise RuntimeError(gone)
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                return await _get_json(url + route, min(HEALTH_PROBE_TIMEOUT_S, timeout_s))
            await anyio.sleep(STARTUP_POLL_S)
    raise RuntimeError(f"no answer from {url}{route} within source.environment.start_timeout_s = {timeout_s:g} s")


class EnvironmentServer:
    """The OpenEnv server process grpod starts for `cfg.name` (module docstring): launched,
    relaunched after a death, stopped by its process group. One lock orders the three."""

    def __init__(self, cfg: EnvironmentConfig, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.log = LaunchLog(self.run_dir / "environment.log")
        self.restarts = 0
        self.generation = 0
        self._socket: socket.socket | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._last_pid: int | None = None
        self._exit_code: int | None = None
        self._lock = anyio.Lock()
        self._relaunch: anyio.CancelScope | None = None
        self._starting = False
        self.sessions = 1  # the steps the running launch runs at once (SESSIONS_ROUTE)
        self.capacity = 1  # the sessions it holds at once (OpenEnv refuses one more)
        self.stuck = 0  # calls that timed out on the running launch

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._socket.getsockname()[1]}"

    @property
    def pid(self) -> int | None:
        """The server's PID (the last launch's once stopped)."""
        return self._last_pid

    @property
    def running(self) -> bool:
        return self._popen is not None and exit_code_of(self._popen) is None

    @property
    def state(self) -> str:
        """"starting" (launched, /health not yet answered), "up" or "down"."""
        if not self.running:
            return "down"
        return "starting" if self._starting else "up"

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", __name__, "serve", self.cfg.name, "--args", json.dumps(self.cfg.args),
                "--memory-mb", str(self.cfg.memory_mb)]
        for directory in self.cfg.path:
            argv += ["--path", str(Path(directory).resolve())]
        return argv + ["--fd", str(self._socket.fileno())]

    def death(self) -> str:
        """What became of the server, for error messages."""
        code = exit_code_of(self._popen) if self._popen is not None else self._exit_code
        status = "is running" if code is None else f"exited with code {code}"
        return f"the environment server (pid {self.pid}, {self.url}) {status}; its log: {self.log.path}"

    async def start(self) -> None:
        """Bind the port and launch; return once healthy (RuntimeError otherwise, nothing left)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._socket = socket.create_server(("127.0.0.1", 0))
        async with self._lock:
            await self._launch()

    async def ensure_running(self) -> int:
        """The generation of a running server: the current one, or a relaunch of a dead one.

        The relaunch serves every episode, not only the caller's, so it is shielded from the
        caller's cancellation (a group is cancelled when a sibling episode lost the same server, and
        its relaunch, killed half-started, cost the next group a launch of its own and the group
        behind it a drop); `wait_healthy` bounds it, and `aclose` cancels it."""
        async with self._lock:
            if not self.running:
                log.warning("openenv_server_restarting", why=self.death())
                await self._stop(signal.SIGKILL)
                self.restarts += 1
                try:
                    with anyio.CancelScope(shield=True) as self._relaunch:
                        await self._launch()
                finally:
                    self._relaunch = None
                if not self.running:
                    raise RuntimeError(f"the OpenEnv server for {self.cfg.name!r} was stopped while it started")
            return self.generation

    async def after_stuck(self, generation: int, why: str) -> None:
        """A call to launch `generation` timed out: count it, and kill that launch (unless already
        replaced) when it serves one session at a time or holds STUCK_LIMIT stuck calls."""
        if generation != self.generation:  # without waiting for the lock a relaunch holds
            return
        async with self._lock:
            if generation != self.generation or not self.running:
                return
            self.stuck += 1
            if self.sessions > 1 and self.stuck < STUCK_LIMIT:
                log.warning("openenv_call_abandoned", pid=self.pid, why=why, stuck=self.stuck, limit=STUCK_LIMIT)
                return
            log.warning("openenv_server_killed", pid=self.pid, why=why, stuck=self.stuck, sessions=self.sessions)
            await self._stop(signal.SIGKILL)

    async def wait_dying(self, generation: int) -> None:
        """After launch `generation` dropped a connection: wait (at most DYING_WAIT_S) until it has
        exited if it is dying. A killed process closes its sockets a moment before it can be
        waited for, and until then the next `open` would take it for alive."""
        popen = self._popen
        if generation != self.generation or popen is None or exit_code_of(popen) is not None:
            return
        pidfd = os.pidfd_open(popen.pid)  # the leader is unreaped until _stop: the PID is still its
        try:
            with anyio.move_on_after(DYING_WAIT_S):
                await anyio.wait_readable(pidfd)
        finally:
            os.close(pidfd)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                if self._relaunch is not None:
                    self._relaunch.cancel()  # it stops what it launched, then lets go of the lock
                async with self._lock:
                    await self._stop(signal.SIGTERM)
            finally:
                if self._socket is not None:
                    self._socket.close()

    async def _launch(self) -> None:
        argv = self.argv()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONUNBUFFERED="1", **parent_env())
        with self.log.open_for_launch(argv) as log_file:
            # From the event loop's thread on purpose: PR_SET_PDEATHSIG fires when the thread that
            # forked the child ends, and a worker thread of anyio's pool ends when idle.
            self._popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                pass_fds=(self._socket.fileno(),), start_new_session=True,
            )  # fmt: skip
        self._last_pid = self._popen.pid
        self.generation += 1
        log.info("openenv_server_launched", pid=self.pid, url=self.url, log=str(self.log.path))
        started = time.monotonic()

        def exited() -> str | None:
            code = exit_code_of(self._popen)
            return None if code is None else f"it exited with code {code}"

        self._starting = True
        try:
            # grpod's own route answers once the app serves, with what its stuck calls cost.
            answer = await wait_healthy(self.url, self.cfg.start_timeout_s, exited, route=SESSIONS_ROUTE)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._stop(signal.SIGKILL)
            if isinstance(exc, RuntimeError):
                raise RuntimeError(
                    f"the OpenEnv server for {self.cfg.name!r} did not start: {exc}; {self.log.excerpt()}"
                ) from None
            raise
        finally:
            self._starting = False
        self.stuck, self.sessions, self.capacity = 0, int(answer["sessions"]), int(answer["capacity"])
        log.info("openenv_server_healthy", pid=self.pid, sessions=self.sessions,
                 elapsed_s=round(time.monotonic() - started, 2))  # fmt: skip

    async def _stop(self, first: signal.Signals) -> None:
        """Signal the group (`first`, then SIGKILL after STOP_GRACE_S), wait until it is gone, and
        reap the leader (only then: until reaped, its PID, the group's ID, cannot be reused)."""
        popen = self._popen
        if popen is None:
            return
        with anyio.CancelScope(shield=True):
            pgid = popen.pid
            for sig, wait_s in ((first, STOP_GRACE_S), (signal.SIGKILL, KILL_WAIT_S)):
                if not release.group_members(pgid):
                    break
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, sig)
                with contextlib.suppress(release.ReleaseTimeoutError):
                    await release.wait_group_gone(pgid, wait_s)
            if popen.poll() is None:  # the leader left its group
                popen.kill()
            self._exit_code = await anyio.to_thread.run_sync(popen.wait, KILL_WAIT_S)
            self._popen = None
            log.info("openenv_server_stopped", pid=pgid, exit_code=self._exit_code, signal=first.name)


class OpenEnvEpisode:
    """One episode: a session on the server's WebSocket endpoint (a `TurnEnvironment`)."""

    def __init__(self, adapter: OpenEnvAdapter, client: Any, where: str, generation: int) -> None:
        self.adapter = adapter
        self.client = client
        self.where = where
        self.generation = generation
        self.turn = 0
        self.total = 0.0
        self.abandoned = False  # a call timed out: its session is stuck on the server

    async def call(self, what: str, request: Callable[[], Awaitable[Any]]) -> Any:
        """`request()` bounded by timeout_s, its failures as `EnvironmentFailure` (module docstring)."""
        where = f"{self.where}, turn {self.turn}: {what}"
        try:
            with anyio.fail_after(self.adapter.cfg.timeout_s):
                return await request()
        except TimeoutError:
            self.abandoned = True
            # Shielded: a sibling episode that loses its connection to a server this kills must not
            # cancel the kill, or this timeout, the cause of the group's drop, before it is raised.
            with anyio.CancelScope(shield=True):
                await self.adapter.after_timeout(self.generation, where)
            raise EnvironmentTimeout(
                f"{where} took longer than source.environment.timeout_s = {self.adapter.cfg.timeout_s:g} s",
            ) from None
        except self.adapter.connection_errors as exc:
            await self.adapter.after_connection_lost(self.generation)
            raise EnvironmentFailure(
                "environment_crash", f"{where}: connection lost ({exc!r}); {self.adapter.server_state()}"
            ) from None
        except (RuntimeError, ValueError) as exc:  # an error answer (GenericEnvClient raises RuntimeError), bad JSON
            raise EnvironmentFailure("environment_error", f"{where}: {exc}") from None
        except (TypeError, AttributeError, KeyError) as exc:  # the client could not parse the answer's shape
            raise EnvironmentFailure("environment_error", f"{where}: a malformed answer ({type(exc).__name__}: {exc})") from None

    async def respond(self, text: str) -> list[Message] | None:
        self.turn += 1
        result = await self.call("step", lambda: self.client.step({self.adapter.text_field: text}))
        where = f"{self.where}, turn {self.turn}"
        reward = step_reward(result.reward, where)
        if not isinstance(result.done, bool):
            raise EnvironmentFailure("environment_error", f"{where}: its `done` is {result.done!r:.40}, expected true or false")
        self.total += reward
        if result.done:
            return None
        return checked_reply(observation_messages(result.observation, where), where)

    async def reward(self) -> float:
        return self.total

    async def aclose(self) -> None:
        """End the session: ask the server to close it and wait until it has. (`client.close()`
        alone closes the socket right after asking, and OpenEnv's server, closing its side,
        logged a WebSocketDisconnect traceback for nearly every episode.)"""
        if self.abandoned:  # the server reads nothing of a session whose step is stuck
            with anyio.CancelScope(shield=True), anyio.move_on_after(ABANDON_CLOSE_S):
                with contextlib.suppress(Exception):
                    await self.client.close()
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.adapter.cfg.timeout_s):
            with contextlib.suppress(Exception):
                if self.client._ws is not None:
                    await self.client._send({"type": "close"})
                    await self.client._ws.wait_closed()
            with contextlib.suppress(Exception):
                await self.client.close()


class OpenEnvAdapter:
    """An OpenEnv environment as an `EnvironmentAdapter` (module docstring)."""

    def __init__(self, cfg: EnvironmentConfig, *, run_dir: Path) -> None:
        if not (cfg.name or cfg.url):
            raise ValueError("source.environment.adapter = 'openenv' needs source.environment.name or .url")
        self.cfg = cfg
        self.name = cfg.name or cfg.url
        self.server = EnvironmentServer(cfg, run_dir) if not cfg.url else None
        self.url = cfg.url.rstrip("/") if cfg.url else None
        self.text_field = "message"
        self.connection_errors: tuple[type[BaseException], ...] = (OSError,)
        self._client_cls: type | None = None
        self._episodes = itertools.count()

    async def __aenter__(self) -> OpenEnvAdapter:
        self._client_cls, self.connection_errors = await anyio.to_thread.run_sync(_client_api)
        try:
            if self.server is not None:
                await self.server.start()
                self.url = self.server.url
            else:
                await wait_healthy(self.url, self.cfg.start_timeout_s, lambda: None)
            schema = await _get_json(f"{self.url}/schema", self.cfg.timeout_s)
            self.text_field = action_field(schema.get("action", {}))
        except BaseException:
            await self.__aexit__()
            raise
        log.info("openenv_ready", environment=self.name, url=self.url, action_field=self.text_field)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.server is not None:
            await self.server.aclose()

    @property
    def session_capacity(self) -> int | None:
        """The episodes the server grpod started holds at once (None: a `url` server, unknown)."""
        return self.server.capacity if self.server is not None else None

    async def open(self, index: int, split: Split) -> tuple[list[Message], OpenEnvEpisode]:
        where = f"openenv environment {self.name} (task {index} of {split})"
        generation = 0
        if self.server is not None:
            try:
                generation = await self.server.ensure_running()
            except RuntimeError as exc:
                raise EnvironmentFailure("environment_crash", f"{where}: {exc}") from None
        client = self._client_cls(
            base_url=self.url, connect_timeout_s=self.cfg.timeout_s, message_timeout_s=2 * self.cfg.timeout_s
        )
        episode = OpenEnvEpisode(self, client, where, generation)
        try:
            seed = task_seed(self.cfg.task_seed, split, index)
            episode_id = f"grpod-{split}-{index}-{next(self._episodes)}"
            result = await episode.call("reset", lambda: client.reset(seed=seed, episode_id=episode_id))
            messages = observation_messages(result.observation, where)
        except BaseException:
            await episode.aclose()
            raise
        return messages, episode

    async def after_timeout(self, generation: int, where: str) -> None:
        if self.server is not None:
            await self.server.after_stuck(generation, f"{where} timed out")

    async def after_connection_lost(self, generation: int) -> None:
        if self.server is not None:
            await self.server.wait_dying(generation)

    def server_state(self) -> str:
        return self.server.death() if self.server is not None else f"the environment server at {self.url} closed it"

    def health(self) -> dict[str, Any]:
        if self.server is None:
            return {"server": self.url}
        server = self.server
        # The PID of a server that is up only: a killed one is relaunched when the next episode
        # opens, and until then its old PID names nothing an operator could signal or watch.
        pid = server.pid if server.running else None
        return {
            "server": self.url, "state": server.state, "pid": pid, "restarts": server.restarts, "stuck": server.stuck,
            "log": str(server.log.path),
        }  # fmt: skip


# ---- the server process (`python -m grpod.rollouts.openenv_adapter serve ...`) ----------------


def action_observation_classes(env_cls: type) -> tuple[type, type]:
    """The Action and Observation classes of an OpenEnv `Environment` subclass: its generic
    parameters (`Environment[MyAction, MyObservation, MyState]`), else its `step`'s annotations."""
    from openenv.core.env_server.types import Action, Observation

    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if len(args) >= 2 and all(isinstance(a, type) for a in args[:2]):
                if issubclass(args[0], Action) and issubclass(args[1], Observation):
                    return args[0], args[1]
    hints = typing.get_type_hints(env_cls.step)
    action, observation = hints.get("action"), hints.get("return")
    if isinstance(action, type) and isinstance(observation, type):
        return action, observation
    raise TypeError(
        f"{env_cls.__name__}: cannot tell its Action and Observation classes; declare it as "
        f"Environment[MyAction, MyObservation, MyState] or annotate step(self, action: MyAction) -> MyObservation"
    )


def _errors_named(env_cls: type, base: type) -> type:
    """`env_cls` whose reset and step (sync or async, where it defines them) raise what they raise
    with its type in the message: OpenEnv answers an error with its str() alone, and a
    MemoryError's (past source.environment.memory_mb) is empty. Signatures are kept
    (`functools.wraps`), and a method the class does not define is not added: OpenEnv calls
    `step_async` only where a class overrides it."""

    def wrapped(method_name: str):
        method = getattr(env_cls, method_name)
        if inspect.iscoroutinefunction(method):
            @functools.wraps(method)
            async def call(self, *args, **kwargs):
                try:
                    return await method(self, *args, **kwargs)
                except Exception as exc:
                    raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
        else:
            @functools.wraps(method)
            def call(self, *args, **kwargs):
                try:
                    return method(self, *args, **kwargs)
                except Exception as exc:
                    raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
        return call

    own = [m for m in ("reset", "step", "reset_async", "step_async") if getattr(env_cls, m) is not getattr(base, m, None)]
    return type(env_cls.__name__, (env_cls,), {m: wrapped(m) for m in own})


def serve(name: str, args: dict[str, Any], path: list[str], *, fd: int | None, host: str, port: int,
          memory_mb: int = 0) -> None:
    """Serve the Environment class `name` with OpenEnv's app until SIGTERM."""
    import uvicorn
    from openenv.core.env_server import create_fastapi_app

    from openenv.core.env_server.interfaces import Environment

    from grpod.rollouts.rewards import RewardLoadError, import_function

    if fd is not None:  # started by an adapter: it dies with the daemon
        die_with_parent()
    if memory_mb:
        cap_memory(memory_mb)
    sys.path[:0] = path
    try:
        env_cls = import_function(name)
    except RewardLoadError as exc:
        sys.exit(f"cannot load the environment class {name!r}: {exc.__cause__ or exc}")
    if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
        sys.exit(f"{name!r} is {env_cls!r}, not a subclass of OpenEnv's Environment")
    action_cls, observation_cls = action_observation_classes(env_cls)
    sessions = MAX_SESSIONS if getattr(env_cls, "SUPPORTS_CONCURRENT_SESSIONS", False) else 1
    if sessions == 1:
        print(f"{name}: SUPPORTS_CONCURRENT_SESSIONS is not set: one episode at a time", file=sys.stderr)
    factory = functools.partial(_errors_named(env_cls, Environment), **args)
    app = create_fastapi_app(factory, action_cls, observation_cls, max_concurrent_envs=sessions)
    parallel = 1 if getattr(env_cls, "REQUIRES_SINGLE_THREAD_EXECUTOR", False) else sessions
    app.get(SESSIONS_ROUTE)(lambda: {"sessions": parallel, "capacity": sessions})
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=UVICORN_GRACE_S)
    sockets = [socket.socket(fileno=fd)] if fd is not None else None
    print(f"serving {name} ({action_cls.__name__} -> {observation_cls.__name__}, {sessions} sessions)", file=sys.stderr)
    uvicorn.Server(config).run(sockets=sockets)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpod.rollouts.openenv_adapter")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("serve", help="serve an OpenEnv Environment class with OpenEnv's app")
    p.add_argument("name", help='"package.module:Class" or "path/to/file.py:Class"')
    p.add_argument("--args", default="{}", help="the class's keyword arguments, a JSON object")
    p.add_argument("--path", action="append", default=[], help="a directory put first on the import path")
    p.add_argument("--fd", type=int, help="a listening socket to serve on (what grpod passes)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8010)
    p.add_argument("--memory-mb", type=int, default=0, help="cap the server's memory (RLIMIT_DATA), MiB; 0: none")
    ns = parser.parse_args(argv)
    serve(ns.name, json.loads(ns.args), ns.path, fd=ns.fd, host=ns.host, port=ns.port, memory_mb=ns.memory_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
