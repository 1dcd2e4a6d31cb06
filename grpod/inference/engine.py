"""`InferenceEngine`: one vLLM engine as the bridges and the `Policy` use it, wherever it runs.

What every engine has, whoever owns its process: the lifetime of its HTTP client (an exit stack
per launch), the availability gate requests wait at while the engine is replaced or its weights
change, the version of the weights it serves, its outstanding requests (least-outstanding
dispatch over a pool), its restart budget, and the health watch's loop. Two kinds say where the
process runs and how its loss is seen:

- `SupervisedInference` (`grpod.inference.supervised`): a process group on this node
  (`InferenceProcess`); its death is seen through a pidfd;
- `RemoteInference` (`grpod.agent.remote`): an engine that a `grpod agent` supervises on another
  node; its death is seen through the agent's API.

Both find a hung engine the same way: `/health` polled every `inference.health_interval_s` while
the gate is open, `inference.health_failures` failures in a row. A closed gate means the engine is
being changed by its owner, who meets failures itself. And both find a stalled engine the same way:
one that answers `/health` (a frozen engine core does: the API server answers for it) but, with
requests in flight, computes no token for `inference.stall_timeout_s`, read from vLLM's own
counters (`/metrics`) while the gate is open. With the gate shut, whoever changes the engine
pauses it through `pause()`, bounded by `inference.stall_timeout_s` like every question the engine
core itself answers, and asks `lost()` after a failure, which also puts such a question to the
core (`/is_paused`) unless a pause already went unanswered.
Relaunches after a loss spend the restart budget (`inference.max_restarts`), with a back-off that
doubles from 1 s up to 30 s between relaunches of the same engine.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog

from grpod.config import InferenceConfig
from grpod.inference.client import InferenceClient, InferenceRequestError
from grpod.service.race import first_of

log = structlog.get_logger(__name__)

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# The stall watch reads the engine's counters this many times per inference.stall_timeout_s.
STALL_READS = 4


class RestartBudgetSpent(RuntimeError):
    """An engine was lost once more than `inference.max_restarts` allows."""


class InferenceUnavailable(RuntimeError):
    """No engine became available to serve requests in time."""


@dataclass(frozen=True)
class EngineLease:
    """One engine lent to a request: the client to call, the model name to ask for, and the policy
    version the engine served when it was lent (`sampled_version` is what the result is tagged with)."""

    engine: InferenceEngine
    client: InferenceClient
    model: str
    version: int

    def sampled_version(self) -> int:
        """The older of the version at the start and now: a sync may land while a request runs."""
        current = self.engine.version if self.engine.version is not None else self.version
        return min(self.version, current)


LostHandler = Callable[["InferenceEngine", str], Awaitable[None]]


class InferenceEngine:
    """One engine (see the module docstring). `launch`, `shutdown` and `relaunch` are called by its
    owner only (the bridge); requests go through `wait_open` / `Policy.engine`.

    A kind provides `process` (what the bridges read: `pid`, `running`, `base_url`, `client()`,
    `cfg`, `gpu`, `fixed_port`, `served_model_names`), `launch`, `shutdown` and `_until_exited`."""

    # Where the engine runs, as `ctl status` shows it.
    node = "local"
    process: Any

    def __init__(self, cfg: InferenceConfig, *, name: str) -> None:
        self.name = name
        self.cfg = cfg
        self.client: InferenceClient | None = None
        self.version: int | None = None
        self.weights: Path | None = None
        self.outstanding = 0
        # The compute threads last set (`set_threads`); None: the launch's own (OMP_NUM_THREADS).
        self.threads: int | None = None
        # Out of the pool's syncs while being relaunched; rejoins after a passing probe.
        self.recovering = False
        self.restarts = 0
        self.launches = 0
        # This launch is stalled: it answers /health but computes nothing (its watch or `lost` found it).
        self.stalled = False
        self._stack: AsyncExitStack | None = None
        self._gate = anyio.Event()
        self._next_launch = anyio.Event()
        self._backoff_s = FIRST_BACKOFF_S

    # ---- lifecycle (the owner's) -----------------------------------------------------------
    async def launch(self, weights: Path, version: int, **launch_kwargs: Any) -> None:
        """Start vLLM on `weights` (returns once healthy), open its client, tag `version`.
        The gate stays closed: the owner opens it once the engine passed its probe."""
        raise NotImplementedError

    async def shutdown(self) -> None:
        """Close the gate and the client, stop the engine and wait until it released everything."""
        raise NotImplementedError

    async def relaunch(self, weights: Path, version: int, phases: dict[str, float] | None = None, **launch_kwargs: Any) -> None:
        """Shut down, then launch on `weights`; the time of each half goes into `phases`."""
        t = time.perf_counter()
        await self.shutdown()
        if phases is not None:
            phases["stop"] = time.perf_counter() - t
        t = time.perf_counter()
        await self.launch(weights, version, **launch_kwargs)
        if phases is not None:
            phases["launch"] = time.perf_counter() - t

    async def _open_client(self, version: int, weights: Path) -> None:
        """After the process is up: open its client (it checks the launch token), tag `version`,
        count the launch and wake a watch waiting for it. Raises with the client closed."""
        stack = AsyncExitStack()
        try:
            self.client = await stack.enter_async_context(self.process.client())
            await self.client.update_weight_version(version)
        except BaseException:
            self.client = None
            with anyio.CancelScope(shield=True):
                await stack.aclose()
            raise
        self._stack = stack
        self.version, self.weights = version, Path(weights)
        self.threads = None
        self.stalled = False
        self.launches += 1
        event, self._next_launch = self._next_launch, anyio.Event()
        event.set()

    async def _close_client(self) -> None:
        """Close the gate and this launch's client (shielded: it only closes a session)."""
        self.close()
        stack, self._stack, self.client = self._stack, None, None
        if stack is not None:
            with anyio.CancelScope(shield=True):
                await stack.aclose()

    async def set_threads(self, threads: int) -> None:
        """Run the model on `threads` threads from its next engine step (a CPU engine launched with
        grpod's worker extension: `grpod.inference.threads_ext`)."""
        assert self.client is not None, f"{self.name}: set_threads while down"
        self.threads = None  # unknown until the engine answers
        (now,) = await self.client.collective_rpc("grpod_set_threads", args=[str(threads)])
        self.threads = int(now)

    def spend_restart(self, reason: str) -> None:
        """Count one relaunch after a loss; RestartBudgetSpent once `inference.max_restarts` are spent."""
        if self.restarts >= self.cfg.max_restarts:
            raise RestartBudgetSpent(
                f"{self.name}: {reason}, and the restart budget (inference.max_restarts = {self.cfg.max_restarts}) is spent"
            )
        self.restarts += 1

    async def healthy(self) -> bool:
        """True when the process runs and `/health` answers 200 within the request timeout."""
        if not self.process.running or self.client is None:
            return False
        try:
            with anyio.fail_after(self.cfg.request_timeout_s):
                return await self.client.health()
        except Exception:  # noqa: BLE001 — any failure to answer is an unhealthy engine
            return False

    async def lost(self) -> bool:
        """True while this launch is lost: it does not answer `/health`, or it is stalled — its
        watch found it so, or its engine core does not answer within `inference.stall_timeout_s`
        (vLLM's API server answers /health for a frozen core) a pause or the question asked here.
        A new launch is not, until found so."""
        if self.stalled or not await self.healthy():
            return True
        assert self.client is not None  # it answered /health
        try:
            await self.client.is_paused()
        except InferenceRequestError as exc:
            if exc.status is None:  # an error answer is an answer (the route may be missing)
                self._core_silent("/is_paused")
        return self.stalled

    async def pause(self) -> None:
        """Shut the gate and pause the engine's scheduler, its requests in flight kept, for a
        change of weights. The engine core answers a pause between two of its steps, so a pause
        unanswered within `inference.stall_timeout_s` by an engine that still answers `/health`
        marks this launch stalled: `lost()` then asks nothing more."""
        self.close()
        assert self.client is not None, f"{self.name}: pause while down"
        try:
            await self.client.pause(mode="keep")
        except InferenceRequestError as exc:
            if exc.status is None and await self.healthy():
                self._core_silent(exc.route)
            raise

    def _core_silent(self, route: str) -> None:
        self.stalled = True
        log.warning("engine_core_silent", engine=self.name, pid=self.process.pid, route=route,
                    waited_s=self.cfg.stall_timeout_s)

    # ---- the availability gate -------------------------------------------------------------
    def open(self) -> None:
        self._gate.set()

    def close(self) -> None:
        if self._gate.is_set():
            self._gate = anyio.Event()

    @property
    def available(self) -> bool:
        return self._gate.is_set() and self.client is not None

    async def wait_open(self) -> None:
        """Return once the gate is open with a client behind it (no timeout: callers bound it)."""
        while True:
            gate = self._gate
            await gate.wait()
            if gate is self._gate and self.client is not None:
                return

    @asynccontextmanager
    async def lease(self, model: str) -> AsyncIterator[EngineLease]:
        """This engine lent to one request (counted in `outstanding` while it runs). The gate
        must be open: callers wait for it first (`Policy.engine`)."""
        assert self.client is not None and self.version is not None, f"{self.name} leased while down"
        self.outstanding += 1
        try:
            yield EngineLease(self, self.client, model, self.version)
        finally:
            self.outstanding -= 1

    # ---- the health watch ------------------------------------------------------------------
    async def watch(self, on_lost: LostHandler) -> None:
        """Until cancelled: wait for the engine to be lost, back off, call `on_lost(self, reason)`.
        `on_lost` relaunches it, or leaves it (the run is stopping or failed); a dead engine left
        as it is is watched again only after its next launch."""
        while True:
            if self.client is None:  # not launched yet, or shut down: nothing to watch
                await self._next_launch.wait()
                continue
            generation = self.launches
            reason = await self._until_lost()
            if self.restarts:
                await anyio.sleep(self._backoff_s)
                self._backoff_s = min(self._backoff_s * 2, MAX_BACKOFF_S)
            await on_lost(self, reason)
            if self.launches == generation and not self.process.running:
                await self._next_launch.wait()

    async def _until_lost(self) -> str:
        """Return why the engine is lost: its process exited, it stopped answering /health, or it
        stopped computing tokens with requests in flight."""
        _, reason = await first_of(self._until_exited, self._until_hung, self._until_stalled)
        return reason

    async def _until_exited(self) -> str:
        """Return once the engine's process is gone, saying how (event-driven where possible)."""
        raise NotImplementedError

    async def _until_hung(self) -> str:
        """Return once `/health` failed `inference.health_failures` times in a row with the gate open,
        or once this launch is marked stalled (a sync that met its silent core left it out)."""
        failures = 0
        while failures < self.cfg.health_failures:
            await anyio.sleep(self.cfg.health_interval_s)
            if self.stalled:  # a change found its core silent (it left the sync): /health answers for it
                return (f"vLLM's engine core did not answer within inference.stall_timeout_s = "
                        f"{self.cfg.stall_timeout_s:g} s, though it answers /health")
            # A closed gate: its owner is changing the engine and meets failures itself; an
            # engine that left a sync (recovering) is watched all the same.
            if (not self._gate.is_set() and not self.recovering) or await self.healthy():
                failures = 0
            else:
                failures += 1
        return f"vLLM did not answer /health {failures} times in a row"

    async def _until_stalled(self) -> str:
        """Return once the engine's token counters stood still for `inference.stall_timeout_s`
        while it had requests in flight (its own gauges, or grpod's leases) and its gate was open.
        A counter that cannot be read proves nothing either way: the /health watch covers an
        engine that does not answer."""
        limit = self.cfg.stall_timeout_s
        tokens: float | None = None
        since = anyio.current_time()
        blind_launch = None
        while True:
            await anyio.sleep(limit / STALL_READS)
            progress = None
            if self._gate.is_set() and self.client is not None:
                try:
                    progress = await self.client.progress()
                except InferenceRequestError as exc:  # unread: neither progress nor a stall
                    if exc.status == 200 and blind_launch != self.launches:  # answered, without counters
                        blind_launch = self.launches
                        log.warning("stall_watch_blind", engine=self.name, error=str(exc)[:300])
                except Exception:  # noqa: BLE001, S110 — unread: neither progress nor a stall, never the watch's end
                    pass
            now = anyio.current_time()
            busy = progress is not None and (progress.in_flight > 0 or self.outstanding > 0)
            if not busy or progress.tokens != tokens:
                tokens, since = (progress.tokens if progress else None), now
                continue
            if now - since >= limit:
                self.stalled = True
                in_flight = max(progress.in_flight, self.outstanding)
                return (f"vLLM computed no token for {now - since:.0f} s with {in_flight} requests in flight "
                        f"(inference.stall_timeout_s = {limit:g}), though it answers /health")

    @property
    def state(self) -> str:
        """serving (gate open), recovering, closed (running, gate shut: a sync or a probe), down."""
        if self.recovering:
            return "recovering"
        if self.available:
            return "serving"
        return "closed" if self.process.running else "down"

    def describe(self) -> dict[str, Any]:
        running = self.process.running
        return {
            "name": self.name,
            "node": self.node,
            "state": self.state,
            "pid": self.process.pid,
            "running": running,
            "base_url": self.process.base_url if running else None,
            "available": self.available,
            "version": self.version,
            "weights": str(self.weights) if self.weights else None,
            "restarts": self.restarts,
            "launches": self.launches,
            "stalled": self.stalled,
            "outstanding": self.outstanding,
            "recovering": self.recovering,
            "threads": self.threads,
        }
