"""`OperatorDesk`: what an operator asks of a running daemon, carried to the step loop.

Requests arrive on the control socket (`grpod ctl`), as signals (SIGTERM/SIGINT stop, SIGHUP
re-reads the config file) or from the daemon itself (a failure stops the run). The desk turns them
into state the step loop reads at its boundaries, and wakes the loop when it waits:

- `pause` / `resume`: `paused`, and an event the loop and the sources wait on while paused;
- `drain`: stop taking rollouts (`draining`, an event the fetch task ends on), train what is
  buffered, checkpoint, stop;
- `sync` / `checkpoint`: a queue of boundary requests; each reply waits until the loop served it
  at the next step boundary (or at once when the loop is idle, waiting for data);
- `set` and SIGHUP: live settings validated now (`grpod.daemon.live`) against the running config
  with every change still pending in it (a second `set` of a key corrects the first), applied at
  the boundary, numbered and kept for `ctl status` and the next checkpoint, from which a resumed
  run applies the `ctl set` values again (`restore`);
- `stop`: `stopping`, set once with the first reason; also set by `close` when the run ends
  any other way. Once it is set, `sync`, `checkpoint`, `set` and `pause` are refused.

Precedence of a setting, kept across reloads: the config file, then the `--set` overrides of
`grpod start`, then `ctl set`. SIGHUP re-reads the file, applies the same `--set` overrides over
it and every value set with `ctl set` over both, and queues what then differs from the running
config: an unchanged file changes nothing, and a key set with `ctl set` keeps that value until
the next `ctl set` of it (the reload logs such keys as `reload_kept_ctl_set`).

Every change that needs the loop's attention sets one event (`attention`); the loop races its
waits against it (`first_or_attention`) instead of polling, and any number of waiters can wait on
it at once. The control commands are the `ctl_*` methods (`commands()` lists them, the CLI too).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import structlog

from grpod.config import ConfigError, GrpodConfig, config_from_tree, read_config_tree, tree_keys
from grpod.daemon.control import ControlError
from grpod.daemon.live import LIVE_KEYS, SettingChange, diff_file, get_key, plan_changes
from grpod.daemon.progress import RunProgress
from grpod.service.race import first_of

log = structlog.get_logger(__name__)

# The newest live changes the run's status and checkpoints keep (each is also in the event log, as
# `config_changed`): a resumed run applies its operator values again, so the list would otherwise
# grow with every restart.
CONFIG_HISTORY = 100

T = TypeVar("T")
BOUNDARY_KINDS = ("sync", "checkpoint")
# The largest config file a reload reads (a config is a few kB; a 16 MB one took 15 s to parse).
RELOAD_MAX_BYTES = 1 << 20
# What a request that needs a boundary is answered once the run is ending.
STOPPING = "the daemon is stopping"


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


def read_reload(path: Path, overrides: list[str], loaded_keys: frozenset[str]) -> tuple[set[str], GrpodConfig]:
    """A reload's read, in a worker thread: the keys `path` sets and the config it makes with the
    `overrides` over it (ConfigError if it cannot be used). The file is read once, so what is
    checked is what is validated; one that no longer sets a key of `loaded_keys` (those it set
    when last loaded) is refused: an emptied or half-written file (an editor's save, a truncated
    copy) would put every key it lost back to its default, the live ones at once."""
    tree = read_config_tree(path, max_bytes=RELOAD_MAX_BYTES)
    file_keys = tree_keys(tree)
    if lost := sorted(loaded_keys - file_keys):
        raise ConfigError(
            f"{path} no longer sets {', '.join(lost[:8])}{' ...' if len(lost) > 8 else ''} "
            f"({len(lost)} keys it set when loaded): refused, so that a half-written file resets "
            f"nothing; to change such a key, write its new value"
        )
    return file_keys, config_from_tree(tree, str(path), overrides)


class OperatorDesk:
    def __init__(self, cfg: GrpodConfig, progress: RunProgress, *, config_path: Path | None = None,
                 overrides: list[str] = (), status: Callable[[], dict[str, Any]] = dict) -> None:
        """`cfg` is the running config (live changes are applied to it in place); `progress` the
        run's (replies name the step); `config_path` and `overrides` what `cfg` was loaded from
        (the file SIGHUP re-reads, `grpod start --set`); `status` answers `ctl status`."""
        self.cfg = cfg
        self.progress = progress
        self.config_path = config_path
        self.overrides = list(overrides)
        # The keys the file set when it was last loaded: a reload that loses any is refused.
        self._file_keys = self._read_file_keys()
        self._reloading = anyio.Lock()
        # The values set with `ctl set`, by key: the last layer of every reload.
        self.operator_values: dict[str, Any] = {}
        self._status = status
        self.paused = False
        self.draining = False
        self.stopping = anyio.Event()
        self.drained = anyio.Event()  # set by `drain`: the fetch task ends on it
        self._resumed = anyio.Event()
        self._resumed.set()
        self._attention = anyio.Event()
        self._requests: list[BoundaryRequest] = []
        # Accepted changes not applied yet, by key (one per key: the latest wins), in order.
        self._changes: dict[str, tuple[SettingChange, str]] = {}
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
        index, result = await first_of(work, self._attention.wait)
        return result if index == 0 else None

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
            change, origin = self._changes.pop(next(iter(self._changes)))
            applied.append(self._apply(change, origin, step))
            on_change(change)
        return applied

    def _apply(self, change: SettingChange, origin: str, step: int) -> dict[str, Any]:
        *sections, leaf = change.key.split(".")
        node: Any = self.cfg
        for part in sections:
            node = getattr(node, part)
        setattr(node, leaf, change.new)
        version = self.config_changes[-1]["version"] + 1 if self.config_changes else 1
        record = {"version": version, "step": step, "origin": origin, **vars(change)}
        self.config_changes.append(record)
        del self.config_changes[:-CONFIG_HISTORY]
        log.info("config_changed", **record)
        return record

    def restore(self, extra: dict[str, Any], origin: str, step: int) -> list[dict[str, Any]]:
        """A resumed run, before anything reads the config: the values the stopped run had from
        `ctl set` (its checkpoint's `operator_values`) go over the file and `--set` again, as a
        reload keeps them, so a restart does not undo an operator's change; the numbered changes
        go on from the checkpoint's (the newest CONFIG_HISTORY kept). A value the config refuses now
        is logged and left out."""
        self.config_changes = list(extra.get("config_changes", []))[-CONFIG_HISTORY:]
        applied = []
        for key, value in extra.get("operator_values", {}).items():
            try:
                changes = plan_changes(self.cfg, {key: value}, origin)[1]
            except ConfigError as exc:
                log.warning("config_restore_refused", key=key, value=value, reason=str(exc))
                continue
            self.operator_values[key] = value
            applied += [self._apply(change, origin, step) for change in changes]
        return applied

    def fail_requests(self, reason: str) -> None:
        """Answer every waiting boundary request with `reason` (the daemon is stopping)."""
        requests, self._requests = self._requests, []
        for request in requests:
            request.complete(error=reason)

    def close(self, reason: str) -> None:
        """The run is ending (`Supervisor._shutdown`), however it ended: a run that ended by itself
        (steps done, drained, the source exhausted) requested no stop, yet no boundary comes any
        more. From now on `sync`, `checkpoint`, `set` and `pause` are refused as for a stop, and
        the requests waiting are answered so."""
        if not self.stopping.is_set():
            log.info("desk_closed", reason=reason, step=self.progress.step)
            self.stopping.set()
        self.wake()
        self.fail_requests(STOPPING)

    def _refuse_when_stopping(self) -> None:
        if self.stop_requested:
            raise ControlError(STOPPING)

    # ---- requests --------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        if not self.stopping.is_set():
            log.info("stop_requested", reason=reason, step=self.progress.step, phase=self.progress.phase.value)
            self.progress.stop_reason = self.progress.stop_reason or reason
            self.stopping.set()
        self.wake()

    async def _boundary(self, kind: str) -> dict[str, Any]:
        self._refuse_when_stopping()
        request = BoundaryRequest(kind)
        self._requests.append(request)
        self.wake()
        await request.done.wait()
        if request.error:
            raise ControlError(request.error)
        return request.result or {}

    def _plan(self, wanted: dict[str, Any], origin: str) -> list[SettingChange]:
        """Validate `wanted` against the running config with the pending changes in it: the
        changes `wanted` makes to what the next boundary would apply (ConfigError if refused)."""
        pending = {key: change.new for key, (change, _) in self._changes.items()}
        planned, _ = plan_changes(self.cfg, pending, origin)
        return plan_changes(planned, wanted, origin)[1]

    def _queue(self, changes: list[SettingChange], origin: str) -> list[SettingChange]:
        """Queue `changes` (from `_plan`), each replacing a pending change of its key; a change back
        to the running value withdraws the pending one. The changes as they will be applied."""
        running = self.cfg.model_dump(mode="json")
        queued = []
        for change in changes:
            self._changes.pop(change.key, None)
            now = get_key(running, change.key)
            if change.new != now:
                queued.append(SettingChange(change.key, now, change.new))
                self._changes[change.key] = (queued[-1], origin)
        self.wake()
        return queued

    def _read_file_keys(self) -> set[str]:
        try:
            return tree_keys(read_config_tree(self.config_path)) if self.config_path is not None else set()
        except ConfigError:
            return set()

    async def reload_file(self) -> None:
        """SIGHUP: re-read the config file, with the `--set` overrides and the `ctl set` values
        over it (the precedence in the module docstring); queue the live keys that differ, refuse
        the rest (logged). A file that cannot be used changes nothing and ends nothing. The file
        is read and parsed in a worker thread (a regular file of at most RELOAD_MAX_BYTES), the
        result applied here on the event loop; reloads apply one at a time, in order."""
        if self.config_path is None:
            log.warning("reload_refused", reason="the daemon was started without --config")
            return
        async with self._reloading:
            await self._reload(self.config_path)

    async def _reload(self, path: Path) -> None:
        origin = f"SIGHUP {path}"
        try:
            file_keys, reloaded = await anyio.to_thread.run_sync(
                read_reload, path, self.overrides, frozenset(self._file_keys)
            )
            layered = reloaded.model_dump(mode="json")
            kept = sorted(key for key, value in self.operator_values.items() if get_key(layered, key) != value)
            if self.operator_values:
                reloaded, _ = plan_changes(reloaded, self.operator_values, origin)
            pending = {key: change.new for key, (change, _) in self._changes.items()}
            planned, _ = plan_changes(self.cfg, pending, origin)
            wanted = diff_file(planned, reloaded)
            refused = sorted(key for key in wanted if key not in LIVE_KEYS)
            live = {key: value for key, value in wanted.items() if key in LIVE_KEYS}
            changes = self._plan(live, origin)
        except ConfigError as exc:
            log.error("reload_refused", path=str(path), reason=str(exc), kept="the running settings; the run goes on")
            return
        except Exception as exc:  # noqa: BLE001 — a reload never ends the run; the log says why
            log.exception("reload_refused", path=str(path), reason=f"{type(exc).__name__}: {exc}")
            return
        if refused:
            log.warning(
                "reload_refused",
                path=str(path),
                keys=refused,
                reason="these keys cannot change while running (restart grpod to apply them)",
            )
        if kept:
            log.info("reload_kept_ctl_set", path=str(path), keys=kept,
                     reason="set with `ctl set`, which takes precedence over the file and --set")
        self._file_keys = file_keys
        queued = self._queue(changes, "SIGHUP")
        log.info("reload_accepted", path=str(path), changes=[vars(c) for c in queued])

    # ---- the control commands (`grpod ctl <name>`) ----------------------------------------
    @classmethod
    def commands(cls) -> tuple[str, ...]:
        return tuple(sorted(name.removeprefix("ctl_") for name in dir(cls) if name.startswith("ctl_")))

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]]:
        return {name: getattr(self, f"ctl_{name}") for name in self.commands()}

    async def ctl_status(self, args: dict[str, Any]) -> dict[str, Any]:
        return self._status()

    async def ctl_pause(self, args: dict[str, Any]) -> dict[str, Any]:
        self._refuse_when_stopping()  # no boundary comes to pause at
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
        """Train what is buffered, checkpoint, stop; a paused run is resumed to do so (a drain that
        waited for `ctl resume` would look like one that hangs)."""
        was_paused = self.paused
        self.draining = True
        self.drained.set()
        self.paused = False
        self._resumed.set()
        self.wake()
        log.info("drain_requested", step=self.progress.step, resumed=was_paused)
        return {"draining": True, "was_paused": was_paused, "step": self.progress.step, "pid": os.getpid()}

    async def ctl_set(self, args: dict[str, Any]) -> dict[str, Any]:
        key, value = args.get("key"), args.get("value")
        if not isinstance(key, str) or "value" not in args:
            raise ControlError('expected args {"key": "train.lr", "value": 1e-5}')
        self._refuse_when_stopping()  # no boundary comes to apply it at (nor a checkpoint to keep it)
        replaced = self._changes.get(key)
        try:
            changes = self._plan({key: value}, "ctl set")
        except ConfigError as exc:
            raise ControlError(str(exc)) from None
        if changes:
            self.operator_values[key] = changes[0].new
        self._queue(changes, "ctl set")
        # `old` is what the next boundary would have applied (a pending value, else the running one).
        reply = {"accepted": [vars(c) for c in changes], "effective": "at the next step boundary", "unchanged": not changes}
        if changes and replaced is not None:
            reply["replaced_pending"] = replaced[0].new
        return reply

    async def ctl_stop(self, args: dict[str, Any]) -> dict[str, Any]:
        self.request_stop("ctl stop")
        return {"stopping": True, "step": self.progress.step, "pid": os.getpid()}
