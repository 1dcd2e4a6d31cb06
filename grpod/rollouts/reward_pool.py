"""`RewardPool`: the worker processes the daemon owns to run user reward code.

Why processes: in a thread, a reward function that hangs could only be abandoned (its thread lives
on, and keeps the interpreter from exiting), one that holds the GIL in C (a backtracking regex)
froze the event loop for as long as it ran, and one that calls `os._exit` or segfaults took the
daemon with it. A worker process can be killed.

Guarantees:
- each call is bounded by `timeout_s`; a worker past it is killed (SIGKILL to the process group
  the pool created for it) and replaced, the call fails as `reward_timeout`;
- a worker that dies mid-call (`os._exit`, SIGSEGV) fails the call as `reward_crash` with its
  exit status or signal, and is replaced;
- a worker over `memory_mb` (its RLIMIT_DATA raises MemoryError in the user's code, and the pool
  also watches its RSS) fails the call as `reward_memory` and is replaced;
- at most `max_outstanding` calls wait or run at once (`reward_overloaded` beyond: a source far
  ahead of its workers); a waiting call gets a worker within `timeout_s` per `workers` calls ahead
  of it, since each of those ends by then (a slow worker is killed at `timeout_s`);
- `aclose()` kills every worker and waits for each; the kernel kills them if the daemon dies;
- a call whose function raised has its traceback written to `log_path` (rewards.log, where the
  workers' prints go): the first of each function and exception type in full, then at most one
  per REPEAT_EVERY_S saying how many were not shown, and at `aclose()` the count of those
  never shown; the call's detail (grpod.log) names the deepest line of the user's code.

Nothing here blocks the event loop: the pipes are anyio streams, the kill and the reaping are
awaited. The pool needs no task of its own: a call that loses its worker spawns the replacement.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from subprocess import PIPE
from typing import Any

import anyio
import anyio.abc
import psutil
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from grpod.errors import first_error
from grpod.rollouts.reward_worker import HEADER, MAX_FRAME
from grpod.service.children import parent_env
from grpod.service.logs import RepeatThrottle
from grpod.service.race import first_of

log = structlog.get_logger(__name__)

# How often a running call's worker has its resident memory looked at.
MEMORY_POLL_S = 0.1
# How long a killed worker may take to be reaped (SIGKILL: milliseconds in practice).
REAP_TIMEOUT_S = 10.0
# Once a reply's length has arrived, its body (written with it) is read without interruption, in
# at most this long: a reader cancelled between the two would leave the stream mid-frame.
BODY_READ_S = 10.0
# What reading from or writing to a worker's pipes raises once it died or its pipe was closed.
PIPE_ERRORS = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.IncompleteRead, OSError)


class RewardPoolError(Exception):
    """The pool cannot start a worker: the functions do not load (the message says why)."""


class PoolCallFailed(Exception):
    """A call did not return rewards; `reason` is what its group is dropped as."""

    def __init__(self, reason: str, detail: str, exc_type: str = "") -> None:
        super().__init__(detail)
        self.reason, self.detail, self.exc_type = reason, detail, exc_type


@dataclass
class _Worker:
    process: anyio.abc.Process
    replies: BufferedByteReceiveStream
    calls: int = 0

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class PoolStats:
    calls: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    replaced: int = 0
    call_s: float = 0.0


class RewardPool:
    def __init__(
        self,
        specs: list[dict[str, Any]],
        *,
        workers: int,
        timeout_s: float,
        memory_mb: int,
        start_timeout_s: float = 120.0,
        log_path: Path | None = None,
        max_outstanding: int | None = None,
    ) -> None:
        """`specs`: one {"name", "function", "pattern"} per function (what the worker imports)."""
        self.specs = specs
        self.size = workers
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.start_timeout_s = start_timeout_s
        self.log_path = log_path
        self.max_outstanding = max_outstanding or max(1024, 64 * workers)
        self.stats = PoolStats()
        self._idle_send, self._idle_receive = anyio.create_memory_object_stream[_Worker](workers)
        self._live: dict[int, _Worker] = {}
        self._missing = 0
        self._outstanding = 0
        self._closed = False
        self._tracebacks = RepeatThrottle()  # by (function, exception type)

    # ---- lifetime --------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every worker; RewardPoolError (and nothing left running) if the functions do not load."""
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(self.size):
                    tg.start_soon(self._add_worker)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            failure = first_error(exc, RewardPoolError)
            if failure is not None:
                raise failure from None
            raise

    async def aclose(self) -> None:
        self._closed = True
        with anyio.CancelScope(shield=True):
            for worker in list(self._live.values()):
                await self._kill(worker)
        for (index, exc_type), held in self._tracebacks.drain().items():
            self._write_log(f"{self._raised(index, exc_type)} {held} more time(s) since its last traceback above "
                            f"(not shown: at most one per {self._tracebacks.every_s:g} s)\n")

    async def __aenter__(self) -> RewardPool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    def pids(self) -> list[int]:
        return sorted(self._live)

    def describe(self) -> dict[str, Any]:
        return {
            "workers": len(self._live),
            "size": self.size,
            "outstanding": self._outstanding,
            "calls": self.stats.calls,
            "failed": dict(self.stats.failed),
            "replaced": self.stats.replaced,
            "mean_call_ms": round(1000 * self.stats.call_s / self.stats.calls, 3) if self.stats.calls else None,
        }

    # ---- calls -----------------------------------------------------------------------------
    async def call(self, index: int, kwargs: dict[str, Any]) -> tuple[list[float | None], dict[str, float]]:
        """Function `index` on `kwargs` in a worker: (rewards, metrics it logged), or PoolCallFailed."""
        if self._closed:
            raise PoolCallFailed("reward_error", "the reward pool is closed (the daemon is stopping)")
        if self._outstanding >= self.max_outstanding:
            raise PoolCallFailed("reward_overloaded", f"{self._outstanding} reward calls outstanding (bound {self.max_outstanding})")
        ahead = self._outstanding
        self._outstanding += 1
        try:
            if self._missing:
                await self._refill()
            wait_s = self.timeout_s * (1 + ahead // max(self.size, 1)) + self.start_timeout_s
            try:
                with anyio.fail_after(wait_s):
                    worker = await self._idle_receive.receive()
            except TimeoutError:
                raise PoolCallFailed("reward_overloaded", f"no reward worker free after {wait_s:.0f} s") from None
            started = anyio.current_time()
            try:
                reply = await self._exchange(worker, index, kwargs)
            except PoolCallFailed as failure:
                self._count(failure.reason)
                await self._replace(worker, failure.reason)
                raise
            except BaseException:  # cancelled mid-call (a stop): its state is unknown; the next call replaces it
                with anyio.CancelScope(shield=True):
                    await self._kill(worker)
                self._missing += 1
                raise
            finally:
                self.stats.calls += 1
                self.stats.call_s += anyio.current_time() - started
            if reply[0] == "failed" and reply[1] == "reward_memory":  # its heap may be in any state now
                await self._replace(worker, "reward_memory")
            else:
                self._idle_send.send_nowait(worker)
        finally:
            self._outstanding -= 1
        if reply[0] == "ok":
            return reply[1], reply[2]
        _, reason, detail, exc_type, formatted = reply
        self._count(reason)
        if formatted:
            self._write_traceback(index, exc_type, formatted)
        raise PoolCallFailed(reason, detail, exc_type)

    # ---- the log of what user code raised ---------------------------------------------------
    def _raised(self, index: int, exc_type: str) -> str:
        spec = self.specs[index]
        stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
        return f"=== grpod {stamp}: reward function {spec['name']!r} ({spec['function']}) raised {exc_type}"

    def _write_traceback(self, index: int, exc_type: str, formatted: str) -> None:
        """`formatted` (a traceback) into the log, unless one of this function and type was written under
        REPEAT_EVERY_S ago (then it is counted, and said with the next one written)."""
        held = self._tracebacks.admit((index, exc_type), anyio.current_time())
        if held is None:
            return
        not_shown = f" ({held} more since the last traceback shown, not shown)" if held else ""
        self._write_log(f"{self._raised(index, exc_type)}{not_shown}:\n{formatted}")

    def _write_log(self, text: str) -> None:
        """Appended to `log_path` (stderr without one, where the workers write then): a traceback
        of at most 64 KiB, at most once per REPEAT_EVERY_S per function and type."""
        try:
            if self.log_path is None:
                sys.stderr.write(text)
                return
            with open(self.log_path, "a") as f:
                f.write(text)
        except OSError as exc:  # a full disk must not fail the reward call
            log.warning("reward_log_write_failed", path=str(self.log_path), error=str(exc))

    async def _exchange(self, worker: _Worker, index: int, kwargs: dict[str, Any]) -> tuple:
        data = pickle.dumps(("call", index, kwargs), protocol=pickle.HIGHEST_PROTOCOL)

        async def exchange() -> tuple | None:
            try:
                await worker.process.stdin.send(HEADER.pack(len(data)) + data)
                return await _read_reply(worker)
            except PIPE_ERRORS:
                return None  # it died: said below

        async def over_memory() -> None:
            while _rss_mb(worker.pid) <= self.memory_mb:
                await anyio.sleep(MEMORY_POLL_S)

        winner, reply = -1, None
        with anyio.move_on_after(self.timeout_s) as deadline:
            winner, reply = await first_of(exchange, over_memory)
        worker.calls += 1
        if winner == 1:
            raise PoolCallFailed("reward_memory", f"the worker's memory passed reward_memory_mb = {self.memory_mb}")
        if deadline.cancelled_caught:
            raise PoolCallFailed("reward_timeout", f"no result after {self.timeout_s:g} s (its worker was killed)")
        if reply is None:
            raise PoolCallFailed("reward_crash", f"its worker died: {await self._death(worker)}")
        return reply

    # ---- workers ---------------------------------------------------------------------------
    def _count(self, reason: str) -> None:
        self.stats.failed[reason] = self.stats.failed.get(reason, 0) + 1

    async def _replace(self, worker: _Worker, reason: str) -> None:
        await self._kill(worker)
        self.stats.replaced += 1
        log.info("reward_worker_replaced", pid=worker.pid, reason=reason, calls=worker.calls)
        self._missing += 1
        await self._refill()

    async def _refill(self) -> None:
        while self._missing and not self._closed:
            self._missing -= 1
            try:
                await self._add_worker()
            except Exception as exc:  # noqa: BLE001 — retried at the next call
                self._missing += 1
                log.error("reward_worker_start_failed", error=str(exc)[:300])
                return

    async def _add_worker(self) -> None:
        command = [sys.executable, "-m", "grpod.rollouts.reward_worker", json.dumps(self.specs), str(self.memory_mb)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **parent_env())
        stderr = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115 — the child keeps it
        try:
            process = await anyio.open_process(command, stdin=PIPE, stdout=PIPE, stderr=stderr, env=env,
                                               start_new_session=True)
        finally:
            if stderr is not None:
                stderr.close()
        worker = _Worker(process, BufferedByteReceiveStream(process.stdout))
        self._live[worker.pid] = worker
        try:
            with anyio.fail_after(self.start_timeout_s):
                hello = await _read_reply(worker)
        except (TimeoutError, anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError) as exc:
            with anyio.CancelScope(shield=True):
                why = f"no answer in {self.start_timeout_s:g} s" if isinstance(exc, TimeoutError) else await self._death(worker)
                await self._kill(worker)
            # A worker that dies importing (os._exit, a crash in a C extension) says nothing itself.
            loading = ", ".join(f"{spec['name']!r} ({spec['function']})" for spec in self.specs)
            raise RewardPoolError(f"a reward worker did not start: {why} (its output is in {self.log_path or 'stderr'}); "
                                  f"it was loading the reward functions {loading}") from None
        if hello[0] != "ready":
            with anyio.CancelScope(shield=True):
                await self._kill(worker)
            raise RewardPoolError(hello[1])
        self._idle_send.send_nowait(worker)

    async def _death(self, worker: _Worker) -> str:
        with anyio.move_on_after(REAP_TIMEOUT_S):
            code = await worker.process.wait()
            if code < 0:
                return f"killed by {signal.Signals(-code).name}"
            return f"exited with status {code}"
        return "its pipe closed"

    async def _kill(self, worker: _Worker) -> None:
        """SIGKILL the process group the pool created for `worker`, and reap it."""
        self._live.pop(worker.pid, None)
        await kill_worker(worker)


async def _read_reply(worker: _Worker) -> tuple:
    """The next reply frame of `worker`. Cancelled while waiting for its length, it loses nothing
    (`receive_exactly` keeps what it read); the body is then read shielded, within BODY_READ_S."""
    (size,) = HEADER.unpack(await worker.replies.receive_exactly(HEADER.size))
    if size > MAX_FRAME:
        raise anyio.BrokenResourceError(f"reply frame of {size} bytes")
    with anyio.CancelScope(shield=True), anyio.move_on_after(BODY_READ_S):
        body = await worker.replies.receive_exactly(size)
        try:
            return tuple(json.loads(body))
        except ValueError as exc:
            raise anyio.BrokenResourceError(f"unreadable reply: {exc}") from None
    raise anyio.BrokenResourceError(f"a reply's body did not follow its length within {BODY_READ_S:g} s")


def _rss_mb(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / (1024 * 1024)
    except psutil.Error:
        return 0.0


async def kill_worker(worker: _Worker) -> None:
    """SIGKILL the process group `worker` leads (its starter created it) and reap it, shielded.

    Also once the worker itself has died and been reaped: what it started (a reward that forked)
    is still in its group, and SIGKILL reaches it there. The group's ID cannot be another's while
    any member lives (Linux reuses no PID that names a live process group); with none left, the
    signal finds nothing (ESRCH), unless the whole PID space wrapped round since the worker died."""
    with anyio.CancelScope(shield=True):
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGKILL)
        with anyio.move_on_after(REAP_TIMEOUT_S):
            await worker.process.wait()
        with suppress(Exception):
            await worker.process.aclose()
