"""`VerifiersAdapter`: a verifiers environment (`source.environment.adapter = "verifiers"`) played
through a worker process in verifiers' own venv.

verifiers 0.4.0 cannot be installed in grpod's venv (it pins openai 2.x and mcp 2.0, below what
vLLM needs), so the environment runs in `.venv-verifiers` (`make verifiers`; `cfg.python` for
another), in `grpod/rollouts/verifiers_worker.py`, which plays the environment's side only: grpod
samples every model turn itself. How the worker maps verifiers' API onto episodes is in its
docstring.

Guarantees:
- one worker, started in a process group of its own on entry, with `PR_SET_PDEATHSIG`; entry
  returns once it has loaded the environment (within `cfg.start_timeout_s`) or raises
  `EnvironmentFailure("environment_error")` saying why, with nothing left running;
- calls run concurrently: the worker plays each as an asyncio task and answers it by its call id
  (`_Channel`), so one episode's slow tool holds up no other;
- each call is bounded by `cfg.timeout_s`. Past it the call is cancelled in the worker (an
  episode it was playing is closed) and fails as `environment_timeout`; the worker and the other
  episodes go on. A worker that does not confirm the cancel within `CANCEL_GRACE_S` has a blocked
  event loop (env code that never yields, e.g. `time.sleep`) and is killed: its other episodes
  fail as `environment_crash` at their next call;
- a worker that dies fails the calls in flight as `environment_crash` with its exit status; the
  env's code raising fails its call as `environment_error` with what it raised and where;
- a killed or dead worker is started again by the next call (counted in `health()["restarts"]`);
  the episodes it held fail as `environment_crash` at their next call (their state died with it);
- a call cancelled mid-way (the run stopping) is cancelled in the worker the same way;
- `__aexit__` kills the worker's process group and reaps it, on every path, cancellation included.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import signal
from pathlib import Path
from subprocess import PIPE
from typing import Any

import anyio
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from grpod.config import EnvironmentConfig
from grpod.rollouts.chat_turns import Message
from grpod.rollouts.environments import EnvironmentFailure, EnvironmentTimeout, Split
from grpod.rollouts.reward_pool import PIPE_ERRORS, _read_reply, _Worker, kill_worker
from grpod.rollouts.reward_worker import HEADER
from grpod.service.children import parent_env

log = structlog.get_logger(__name__)

WORKER = Path(__file__).with_name("verifiers_worker.py")
DEFAULT_PYTHON = Path(".venv-verifiers/bin/python")
_REPO = Path(__file__).resolve().parents[2]
# A call past cfg.timeout_s is cancelled in the worker; a worker that has not confirmed the cancel
# this long after has a blocked event loop and is killed. A live loop confirms within
# milliseconds; it stays under the source's own margin (environment_source.ADAPTER_MARGIN_S), so
# the adapter's verdict is the one a dropped group reports.
CANCEL_GRACE_S = 3.0


def worker_python(cfg: EnvironmentConfig) -> Path:
    """The verifiers venv's interpreter: `cfg.python`, else `.venv-verifiers` in the working
    directory or grpod's checkout; EnvironmentFailure naming `make verifiers` if there is none."""
    candidates = [cfg.python] if cfg.python is not None else [DEFAULT_PYTHON, _REPO / DEFAULT_PYTHON]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate.absolute()
    raise EnvironmentFailure(
        "environment_error",
        f"source.environment.python: no interpreter at {candidates[0]} — the verifiers adapter runs the "
        "environment in a venv of its own: run `make verifiers` (builds .venv-verifiers), or set "
        "source.environment.python to a venv that has verifiers==0.4.0",
    )


class _Broken(Exception):
    """The worker's pipe closed or broke."""


class _Channel:
    """Calls to one worker, answered out of order by call id.

    No task of its own reads the worker's replies: a caller waiting for its reply reads the next
    frame itself when no other caller is reading, and hands every frame to the call it answers;
    the others wait for `moved`. A reply nobody waits for any more (its call timed out) is
    dropped. `_read_reply` reads a frame whole even when its reader is cancelled."""

    def __init__(self, worker: _Worker) -> None:
        self.worker = worker
        self.replies: dict[int, tuple | None] = {}  # the calls waited for: None until answered
        self.reading = False
        self.moved = anyio.Event()
        self.broken: str | None = None
        self.ids = itertools.count(1)
        self._send_lock = anyio.Lock()

    def next_id(self) -> int:
        return next(self.ids)

    async def call(self, call_id: int, op: str, *args: Any) -> tuple:
        """The reply to call `call_id`, (op, *args); _Broken once the pipe closes."""
        self.replies[call_id] = None
        try:
            data = pickle.dumps((call_id, op, *args), protocol=pickle.HIGHEST_PROTOCOL)
            try:
                async with self._send_lock:
                    await self.worker.process.stdin.send(HEADER.pack(len(data)) + data)
            except PIPE_ERRORS as exc:
                raise _Broken(f"{type(exc).__name__} on send") from None
            return await self._reply(call_id)
        finally:
            self.replies.pop(call_id, None)

    async def _reply(self, call_id: int) -> tuple:
        while True:
            reply = self.replies[call_id]
            if reply is not None:
                return reply
            if self.broken is not None:
                raise _Broken(self.broken)
            if self.reading:
                await self.moved.wait()
                continue
            self.reading = True
            try:
                frame = await _read_reply(self.worker)
                if frame and frame[0] in self.replies:
                    self.replies[frame[0]] = frame[1:]
            except PIPE_ERRORS as exc:
                self.broken = f"{type(exc).__name__}: {exc}"
            finally:
                self.reading = False
                self.moved.set()
                self.moved = anyio.Event()


class VerifiersEpisode:
    """One episode in the worker (a `TurnEnvironment`)."""

    def __init__(self, adapter: VerifiersAdapter, key: int, generation: int) -> None:
        self.adapter, self.key, self.generation = adapter, key, generation

    async def respond(self, text: str) -> list[Message] | None:
        return await self.adapter._episode_call(self, "respond", text)

    async def reward(self) -> float:
        return float(await self.adapter._episode_call(self, "reward"))

    async def aclose(self) -> None:
        if self.generation != self.adapter.generation or self.adapter.channel is None:
            return  # its worker is gone, and the episode with it
        try:
            await self.adapter._call("close", self.key)
        except EnvironmentFailure as failure:
            log.info("verifiers_episode_close_failed", episode=self.key, reason=failure.reason)


class VerifiersAdapter:
    """A verifiers environment through one supervised worker process (module docstring)."""

    def __init__(self, cfg: EnvironmentConfig, *, run_dir: Path) -> None:
        self.cfg = cfg
        self.name = f"verifiers:{cfg.name}"
        self.log_path = Path(run_dir) / "verifiers-worker.log"
        self.channel: _Channel | None = None
        self.generation = 0  # bumped at every worker start: an episode knows which one holds it
        self.restarts = 0
        self.cancelled = 0  # calls cancelled in the worker past their timeout, the worker kept
        self.failures: dict[str, int] = {}
        self._start_lock = anyio.Lock()

    @property
    def worker(self) -> _Worker | None:
        return self.channel.worker if self.channel is not None else None

    # ---- lifetime --------------------------------------------------------------------------
    async def __aenter__(self) -> VerifiersAdapter:
        try:
            async with self._start_lock:
                await self._start()
        except BaseException:
            await self._stop(self.channel)
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop(self.channel)

    def health(self) -> dict[str, Any]:
        return {
            "worker_pid": self.worker.pid if self.worker else None,
            "restarts": self.restarts,
            "calls_in_flight": len(self.channel.replies) if self.channel else 0,
            "cancelled": self.cancelled,
            "failed": dict(self.failures),
            "log": str(self.log_path),
        }

    # ---- episodes --------------------------------------------------------------------------
    async def open(self, index: int, split: Split) -> tuple[list[Message], VerifiersEpisode]:
        key, messages = await self._call("open", index, split)
        return messages, VerifiersEpisode(self, key, self.generation)

    async def task(self, index: int, split: Split) -> list[Message]:
        """Task `index`'s opening messages, without opening an episode."""
        return await self._call("task", index, split)

    async def _episode_call(self, episode: VerifiersEpisode, op: str, *args: Any) -> Any:
        if episode.generation != self.generation:
            raise self._failure(EnvironmentFailure(
                "environment_crash",
                f"the verifiers worker was restarted since episode {episode.key} opened (its state died with the old worker)",
            ))
        return await self._call(op, episode.key, *args)

    # ---- the worker ------------------------------------------------------------------------
    async def _call(self, op: str, *args: Any) -> Any:
        """One call to the worker and its reply, bounded by cfg.timeout_s (module docstring)."""
        async with self._start_lock:
            if self.channel is None:
                self.restarts += 1
                await self._start()
            channel = self.channel
        name, call_id = self.cfg.name, channel.next_id()
        try:
            with anyio.move_on_after(self.cfg.timeout_s) as deadline:
                reply = await channel.call(call_id, op, *args)
        except _Broken as broken:
            death = await self._death(channel.worker)
            await self._stop(channel)
            raise self._failure(EnvironmentFailure(
                "environment_crash",
                f"verifiers environment {name!r}: its worker's channel broke during {op} ({broken}; the worker: "
                f"{death}); its output is in {self.log_path}",
            )) from None
        except BaseException:  # cancelled from outside: the worker drops the call too
            await self._cancel(channel, call_id)
            raise
        if deadline.cancelled_caught:
            kept = await self._cancel(channel, call_id)
            raise self._failure(EnvironmentTimeout(
                f"verifiers environment {name!r}: {op} took longer than source.environment.timeout_s = "
                f"{self.cfg.timeout_s:g} s " + ("(cancelled in the worker, which goes on)" if kept else
                f"(the worker did not confirm the cancel within {CANCEL_GRACE_S:g} s, so its event loop is blocked: "
                "killed, restarted at the next call)")
            ))
        if reply[0] == "error":
            raise self._failure(EnvironmentFailure(
                "environment_error", f"verifiers environment {name!r}, {reply[1]}: {reply[2]}"
            ))
        return reply[1]

    async def _cancel(self, channel: _Channel, call_id: int) -> bool:
        """Cancel call `call_id` in the worker, shielded: True once the worker confirms; else its
        event loop is blocked (or it died) and it is killed."""
        with anyio.CancelScope(shield=True):
            if self.channel is not channel or channel.broken is not None:
                await self._stop(channel)  # gone already, and the call with it
                return False
            with anyio.move_on_after(CANCEL_GRACE_S):
                try:
                    await channel.call(channel.next_id(), "cancel", call_id)
                    self.cancelled += 1
                    return True
                except _Broken:
                    pass
            log.warning("verifiers_worker_killed", pid=channel.worker.pid,
                        why=f"no confirmation of a cancel within {CANCEL_GRACE_S:g} s")
            await self._stop(channel)
            return False

    def _failure(self, failure: EnvironmentFailure) -> EnvironmentFailure:
        """`failure`, counted by its reason."""
        self.failures[failure.reason] = self.failures.get(failure.reason, 0) + 1
        return failure

    async def _start(self) -> None:
        python = worker_python(self.cfg)
        spec = {
            "name": self.cfg.name,
            "args": {k: v for k, v in self.cfg.args.items() if k != "eval"},
            "eval_args": self.cfg.args.get("eval") or {},
            "path": [str(Path(p).absolute()) for p in self.cfg.path],
            "memory_mb": self.cfg.memory_mb,
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as stderr:
            process = await anyio.open_process([str(python), str(WORKER), json.dumps(spec)], stdin=PIPE, stdout=PIPE,
                                               stderr=stderr, start_new_session=True, env={**os.environ, **parent_env()})
        worker = _Worker(process, BufferedByteReceiveStream(process.stdout))
        self.channel = channel = _Channel(worker)
        self.generation += 1
        try:
            with anyio.fail_after(self.cfg.start_timeout_s):
                hello = await _read_reply(worker)
        except (TimeoutError, anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as exc:
            why = (f"no answer in source.environment.start_timeout_s = {self.cfg.start_timeout_s:g} s"
                   if isinstance(exc, TimeoutError) else await self._death(worker))
            await self._stop(channel)
            raise EnvironmentFailure("environment_error", f"the verifiers worker for {self.cfg.name!r} did not start: "
                                     f"{why} (its output is in {self.log_path})") from None
        if hello[0] != "ready":
            await self._stop(channel)
            raise EnvironmentFailure("environment_error", f"verifiers environment {self.cfg.name!r} does not load "
                                     f"(source.environment.name / args / path): {hello[1]}")
        log.info("verifiers_worker_ready", pid=worker.pid, env=hello[1], generation=self.generation)

    async def _death(self, worker: _Worker) -> str:
        with anyio.move_on_after(1.0):
            code = await worker.process.wait()
            return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        return "its pipe closed"

    async def _stop(self, channel: _Channel | None) -> None:
        """SIGKILL `channel`'s worker's process group (the adapter created it) and reap it."""
        if channel is None:
            return
        if self.channel is channel:
            self.channel = None
        await kill_worker(channel.worker)
