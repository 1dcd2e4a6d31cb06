"""`OperatorDesk`: what an operator asks of a running daemon, carried to the step loop.

Requests arrive on the control socket (`grpod ctl`), as signals (SIGTERM/SIGINT stop, SIGHUP
re-reads the config file) or from the daemon itself (a failure stops the run). The desk turns them
into state the step loop reads at its boundaries, and wakes the loop when it waits:

- `pause` / `resume`: `paused`, and an event the loop and the sources wait on while paused;
- `drain`: stop taking rollouts (`draining`, an event the fetch task ends on), train what is
  buffered, checkpoint, stop;
- `sync` / `checkpoint`: a queue of boundary requests; each reply waits until the loop served it
  at the next step boundary (or at once when the loop is idle, waiting for data);
- `set` and SIGHUP: live settings validated now (`grpod.daemon.live`), applied at the boundary,
  numbered and kept for `ctl status` and the next checkpoint;
- `stop`: `stopping`, set once with the first reason.

Every change that needs the loop's attention sets one event (`attention`); the loop races its
waits against it (`first_or_attention`) instead of polling, and any number of waiters can wait on
it at once. The control commands are the `ctl_*` methods (`commands()` lists them, the CLI too).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import structlog

from grpod.config import ConfigError, GrpodConfig, load_config
from grpod.daemon.control import ControlError
from grpod.daemon.live import LIVE_KEYS, SettingChange, diff_file, plan_changes
from grpod.daemon.progress import RunProgress

log = structlog.get_logger(__name__)

T = TypeVar("T")
BOUNDARY_KINDS = ("sync", "checkpoint")


@dataclass
class BoundaryRequest:
    """An operator request served at the next step boundary; its reply waits for `done`."""

    kind: str
    done: anyio.Event = field(default_factory=anyio.Event)
    result: dict[str, Any] | None = None
    error: str | None = None

    def complete(self, result: dict[str, Any] | None = None, error: str | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class OperatorDesk:
    def __init__(self, cfg: GrpodConfig, progress: RunProgress, *, config_path: Path | None = None,
                 status: Callable[[], dict[str, Any]] = dict) -> None:
        """`cfg` is the running config (live changes are applied to it in place); `progress` the
        run's (replies name the step); `status` answers `ctl status`."""
        self.cfg = cfg
        self.progress = progress
        self.config_path = config_path
        self._status = status
        self.paused = False
        self.draining = False
        self.stopping = anyio.Event()
        self.drained = anyio.Event()  # set by `drain`: the fetch task ends on it
        self._resumed = anyio.Event()
        self._resumed.set()
        self._attention = anyio.Event()
        self._requests: list[BoundaryRequest] = []
        self._changes: list[tuple[SettingChange, str]] = []
        self.config_changes: list[dict[str, Any]] = []

    # ---- what needs the loop --------------------------------------------------------------
    def wake(self) -> None:
        """Something needs the loop's attention (also: the source ended)."""
        self._attention.set()

    @property
    def stop_requested(self) -> bool:
        return self.stopping.is_set()

    def pending(self) -> bool:
        """Something the loop must act on at its boundary."""
        return bool(self._requests or self._changes) or self.stop_requested

    async def first_or_attention(self, work: Callable[[], Awaitable[T]]) -> T | None:
        """`await work()`, unless something needs the loop's attention first (a request, a
        change, resume, drain, stop): then `work` is cancelled and None returned. `work` must be
        safe to cancel (lose nothing). Once woken, it returns None until the loop `settle`s."""
        if self.pending() or self._attention.is_set():
            return None
        result: T | None = None
        attention = self._attention
        async with anyio.create_task_group() as tg:

            async def run() -> None:
                nonlocal result
                result = await work()
                tg.cancel_scope.cancel()

            async def interrupt() -> None:
                await attention.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(run)
            tg.start_soon(interrupt)
        return result

    def settle(self) -> None:
        """The loop has looked at everything: the next change wakes it again."""
        if self._attention.is_set() and not self.pending():
            self._attention = anyio.Event()

    async def wait_resumed(self) -> None:
        """Return once not paused (sources await it before each request)."""
        await self._resumed.wait()

    def take_requests(self, kind: str) -> list[BoundaryRequest]:
        taken = [r for r in self._requests if r.kind == kind]
        self._requests = [r for r in self._requests if r.kind != kind]
        return taken

    def has_request(self, kind: str) -> bool:
        return any(r.kind == kind for r in self._requests)

    def apply_changes(self, step: int, on_change: Callable[[SettingChange], None]) -> list[dict[str, Any]]:
        """Apply accepted live changes to the running config (in place: components hold its
        sections), call `on_change` for each (the trainer's learning rate), and record them."""
        applied = []
        while self._changes:
            change, origin = self._changes.pop(0)
            *sections, leaf = change.key.split(".")
            node: Any = self.cfg
            for part in sections:
                node = getattr(node, part)
            setattr(node, leaf, change.new)
            on_change(change)
            record = {"version": len(self.config_changes) + 1, "step": step, "origin": origin, **vars(change)}
            self.config_changes.append(record)
            log.info("config_changed", **record)
            applied.append(record)
        return applied

    def fail_requests(self, reason: str) -> None:
        """Answer every waiting boundary request with `reason` (the daemon is stopping)."""
        requests, self._requests = self._requests, []
        for request in requests:
            request.complete(error=reason)

    # ---- requests --------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        if not self.stopping.is_set():
            log.info("stop_requested", reason=reason, step=self.progress.step, phase=self.progress.phase.value)
            self.progress.stop_reason = self.progress.stop_reason or reason
            self.stopping.set()
        self.wake()

    async def _boundary(self, kind: str) -> dict[str, Any]:
        if self.stop_requested:
            raise ControlError("the daemon is stopping")
        request = BoundaryRequest(kind)
        self._requests.append(request)
        self.wake()
        await request.done.wait()
        if request.error:
            raise ControlError(request.error)
        return request.result or {}

    def reload_file(self) -> None:
        """SIGHUP: re-read the config file; queue the live subset, refuse the rest (logged)."""
        if self.config_path is None:
            log.warning("reload_refused", reason="the daemon was started without --config")
            return
        try:
            reloaded = load_config(self.config_path)
            wanted = diff_file(self.cfg, reloaded)
            refused = sorted(key for key in wanted if key not in LIVE_KEYS)
            live = {key: value for key, value in wanted.items() if key in LIVE_KEYS}
            _, changes = plan_changes(self.cfg, live, f"SIGHUP {self.config_path}")
        except ConfigError as exc:
            log.error("reload_refused", path=str(self.config_path), reason=str(exc))
            return
        if refused:
            log.warning(
                "reload_refused",
                path=str(self.config_path),
                keys=refused,
                reason="these keys cannot change while running (restart grpod to apply them)",
            )
        log.info("reload_accepted", path=str(self.config_path), changes=[vars(c) for c in changes])
        self._changes.extend((change, "SIGHUP") for change in changes)
        self.wake()

    # ---- the control commands (`grpod ctl <name>`) ----------------------------------------
    @classmethod
    def commands(cls) -> tuple[str, ...]:
        return tuple(sorted(name.removeprefix("ctl_") for name in dir(cls) if name.startswith("ctl_")))

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]]:
        return {name: getattr(self, f"ctl_{name}") for name in self.commands()}

    async def ctl_status(self, args: dict[str, Any]) -> dict[str, Any]:
        return self._status()

    async def ctl_pause(self, args: dict[str, Any]) -> dict[str, Any]:
        self.paused = True
        if self._resumed.is_set():
            self._resumed = anyio.Event()
        self.wake()
        log.info("paused", step=self.progress.step)
        return {"paused": True, "effective": "at the next step boundary", "step": self.progress.step}

    async def ctl_resume(self, args: dict[str, Any]) -> dict[str, Any]:
        was = self.paused
        self.paused = False
        self._resumed.set()
        self.wake()
        log.info("resumed", step=self.progress.step)
        return {"paused": False, "was_paused": was, "step": self.progress.step}

    async def ctl_sync(self, args: dict[str, Any]) -> dict[str, Any]:
        return await self._boundary("sync")

    async def ctl_checkpoint(self, args: dict[str, Any]) -> dict[str, Any]:
        return await self._boundary("checkpoint")

    async def ctl_drain(self, args: dict[str, Any]) -> dict[str, Any]:
        self.draining = True
        self.drained.set()
        self.wake()
        log.info("drain_requested", step=self.progress.step)
        return {"draining": True, "step": self.progress.step}

    async def ctl_set(self, args: dict[str, Any]) -> dict[str, Any]:
        key, value = args.get("key"), args.get("value")
        if not isinstance(key, str) or "value" not in args:
            raise ControlError('expected args {"key": "train.lr", "value": 1e-5}')
        try:
            _, changes = plan_changes(self.cfg, {key: value}, "ctl set")
        except ConfigError as exc:
            raise ControlError(str(exc)) from None
        self._changes.extend((change, "ctl set") for change in changes)
        self.wake()
        return {
            "accepted": [vars(c) for c in changes],
            "effective": "at the next step boundary",
            "unchanged": not changes,
        }

    async def ctl_stop(self, args: dict[str, Any]) -> dict[str, Any]:
        self.request_stop("ctl stop")
        return {"stopping": True, "step": self.progress.step}
