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
- calls are serialised (the worker answers one at a time) and each is bounded by
  `cfg.timeout_s`: past it the worker is killed and the call fails as `environment_timeout`; a
  worker that dies fails the call as `environment_crash` with its exit status; the env's code
  raising fails it as `environment_error` with what it raised and where;
- a killed or dead worker is started again by the next call (counted in `health()["restarts"]`);
  the episodes it held fail as `environment_crash` at their next call (their state died with it);
- a call cancelled mid-way kills the worker (its reply would desynchronise the pipe);
- `__aexit__` kills the worker's process group and reaps it, on every path, cancellation included.
"""

from __future__ import annotations

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
from grpod.rollouts.reward_pool import _read_reply, _Worker, kill_worker
from grpod.rollouts.reward_worker import HEADER

log = structlog.get_logger(__name__)

WORKER = Path(__file__).with_name("verifiers_worker.py")
DEFAULT_PYTHON = Path(".venv-verifiers/bin/python")
_REPO = Path(__file__).resolve().parents[2]


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


class VerifiersEpisode:
    """One episode in the worker (a `TurnEnvironment`)."""

    def __init__(self, adapter: VerifiersAdapter, key: int, generation: int) -> None:
        self.adapter, self.key, self.generation = adapter, key, generation

    async def respond(self, text: str) -> list[Message] | None:
        return await self.adapter._episode_call(self, "respond", text)

    async def reward(self) -> float:
        return float(await self.adapter._episode_call(self, "reward"))

    async def aclose(self) -> None:
        if self.generation != self.adapter.generation or self.adapter.worker is None:
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
        self.worker: _Worker | None = None
        self.generation = 0  # bumped at every worker start: an episode knows which one holds it
        self.restarts = 0
        self.failures: dict[str, int] = {}
        self._lock = anyio.Lock()

    # ---- lifetime --------------------------------------------------------------------------
    async def __aenter__(self) -> VerifiersAdapter:
        try:
            async with self._lock:
                await self._start()
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stop()

    def health(self) -> dict[str, Any]:
        return {
            "worker_pid": self.worker.pid if self.worker else None,
            "restarts": self.restarts,
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
        """One request to the worker and its reply, bounded by cfg.timeout_s (module docstring)."""
        async with self._lock:
            if self.worker is None:
                self.restarts += 1
                await self._start()
            worker = self.worker
            data = pickle.dumps((op, *args), protocol=pickle.HIGHEST_PROTOCOL)
            reply: tuple | None = None
            try:
                with anyio.move_on_after(self.cfg.timeout_s) as deadline:
                    try:
                        await worker.process.stdin.send(HEADER.pack(len(data)) + data)
                        reply = await _read_reply(worker)
                    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.IncompleteRead, OSError):
                        reply = None
            except BaseException:  # cancelled mid-call: its reply would desynchronise the pipe
                await self._stop()
                raise
            if deadline.cancelled_caught:
                await self._stop()
                raise self._failure(EnvironmentTimeout(
                    f"verifiers environment {self.cfg.name!r}: {op} took longer than source.environment.timeout_s = "
                    f"{self.cfg.timeout_s:g} s (worker killed; restarted at the next call)"
                ))
            if reply is None:
                death = await self._death(worker)
                await self._stop()
                raise self._failure(EnvironmentFailure(
                    "environment_crash",
                    f"verifiers environment {self.cfg.name!r}: its worker died during {op} ({death}); its output is in "
                    f"{self.log_path}",
                ))
        if reply[0] == "error":
            raise self._failure(EnvironmentFailure(
                "environment_error", f"verifiers environment {self.cfg.name!r}, {reply[1]}: {reply[2]}"
            ))
        return reply[1]

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
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as stderr:
            process = await anyio.open_process([str(python), str(WORKER), json.dumps(spec)], stdin=PIPE, stdout=PIPE,
                                               stderr=stderr, start_new_session=True)
        worker = _Worker(process, BufferedByteReceiveStream(process.stdout))
        self.worker = worker
        self.generation += 1
        try:
            with anyio.fail_after(self.cfg.start_timeout_s):
                hello = await _read_reply(worker)
        except (TimeoutError, anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as exc:
            why = (f"no answer in source.environment.start_timeout_s = {self.cfg.start_timeout_s:g} s"
                   if isinstance(exc, TimeoutError) else await self._death(worker))
            await self._stop()
            raise EnvironmentFailure("environment_error", f"the verifiers worker for {self.cfg.name!r} did not start: "
                                     f"{why} (its output is in {self.log_path})") from None
        if hello[0] != "ready":
            await self._stop()
            raise EnvironmentFailure("environment_error", f"verifiers environment {self.cfg.name!r} does not load "
                                     f"(source.environment.name / args / path): {hello[1]}")
        log.info("verifiers_worker_ready", pid=worker.pid, env=hello[1], generation=self.generation)

    async def _death(self, worker: _Worker) -> str:
        with anyio.move_on_after(1.0):
            code = await worker.process.wait()
            return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        return "its pipe closed"

    async def _stop(self) -> None:
        """SIGKILL the worker's process group (the adapter created it) and reap it."""
        worker, self.worker = self.worker, None
        if worker is None:
            return
        await kill_worker(worker)
