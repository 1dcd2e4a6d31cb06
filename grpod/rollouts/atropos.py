"""The Atropos rollout source: scored groups from a running Atropos trajectory API (`run-api`).

grpod plays the trainer's side of run-api's protocol (notes/atropos.md):

    POST /register   at start, and again whenever the API may have lost its memory (a restart)
    GET  /info       after registering: the batch size and token limit the API actually holds
    GET  /batch      polled; `{"batch": null}` → wait `source.atropos_poll_s`, doubling up to
                     MAX_WAIT_S, and ask again; a batch resets the wait
    GET  /status     read after registering and with every empty poll (API step, queued groups)

What is guaranteed:
- The group-size rule is checked before anything is sent: run-api packs groups into bundles of the
  largest group size and forms a batch only from bundles summing exactly to `batch_size`; its
  contract is group sizes that are powers of two dividing `batch_size` (it documents this and
  relies on it for groups of mixed sizes). Any other `source.group_size` is refused at start with
  `AtroposConfigError`, because the failure at run time is silent: the API just never answers
  with a batch. Checking first also keeps a bad `batch_size` out of the API, whose first
  registration wins for as long as it runs.
- The API being down, restarting, slow or answering garbage never ends the source: it waits with
  the same doubling back-off, shows `api_state = "waiting_for_api"` and `last_error`, and
  registers again once the API answers (a restarted run-api has forgotten the trainer; its
  `GET /batch` then says "Trainer not registered", which also triggers a new registration).
  Registering again never resets a live API's queue.
- Nothing the API handed over is lost: run-api forgets a batch once it has sent it, so the
  request is finished even when the fetch task is being cancelled (bounded by the request
  timeout), and every converted group sits either in the `RolloutBuffer` or in the source's
  pending list, which `cursor()` records (key "pending") for the checkpoint. The next batch is
  requested only when the buffer has room for a whole batch (`train.groups_per_step` groups), so
  the pending list is normally empty.
- Each batch item goes through `group_from_atropos`; an item that cannot be converted is counted
  in the daemon's rejection counter by reason and logged (`group_rejected`), the rest of the batch is kept.
  Range checks (vocabulary, lengths, NaN, ...) are the supervisor's `validate_batch`, as for
  every source.

Policy version rule: Atropos items carry no policy version. A group is tagged with the version
vLLM serves when its batch is received (`bridge.policy_version` at that moment). That is the
newest version it can have been sampled under, so staleness is under-estimated by the time
the group spent in the environment and in run-api's queue, never over-estimated.

Cursor: `{"kind": "atropos", "batches": n, "step": s[, "pending": [group, ...]]}`: `batches`
counts batches received over the life of the run, `step` is the step to register with (the
`starting_step` run-api hands to environments): the resumed step plus the batches received
since. A cursor may carry `starting_step` instead of `step` (the daemon's step on resume).

`stats.api_state`: starting → registering → polling ⇄ buffer_full; any state → waiting_for_api
on a failed request → registering once the API answers again.
"""

from __future__ import annotations

import enum
import json
import sys
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import structlog

from grpod.config import AtroposSourceConfig
from grpod.http import RequestError, SessionClient
from grpod.inference.policy import Policy
from grpod.rollouts.atropos_wire import group_from_atropos
from grpod.rollouts.buffer import RolloutBuffer
from grpod.rollouts.group import RolloutGroup
from grpod.rollouts.source import MayGenerate, SourceStats
from grpod.rollouts.validation import MalformedGroup, RejectionCounter, record_rejection

log = structlog.get_logger(__name__)

# Longest wait between two polls of an empty queue or two attempts at an unreachable API.
MAX_WAIT_S = 8.0
# While no batch arrives, a console line every WAITING_LINE_S says so (run.progress).
WAITING_LINE_S = 30.0
REQUEST_TIMEOUT_S = 30.0
BODY_EXCERPT_CHARS = 300


class AtroposConfigError(ValueError):
    """The configuration cannot work with run-api; the message says which keys to change."""


class TrajectoryApiError(RequestError):
    """A request to run-api failed; `status` is None when no HTTP answer came back."""

    server = "Atropos API"


class TrainerNotRegistered(TrajectoryApiError):
    """run-api does not know this trainer (it restarted, or was reset)."""


class ApiState(enum.Enum):
    STARTING = "starting"
    REGISTERING = "registering"
    POLLING = "polling"
    BUFFER_FULL = "buffer_full"
    WAITING_FOR_API = "waiting_for_api"


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_batch_geometry(batch_size: int, group_size: int, groups_per_step: int | None = None) -> None:
    """Raise AtroposConfigError unless `group_size` is a power of two dividing `batch_size`."""
    if _is_power_of_two(group_size) and batch_size > 0 and batch_size % group_size == 0:
        return
    lower = 1 << (max(group_size, 1).bit_length() - 1)
    suggestion = f"{lower} or {lower * 2}" if lower != group_size else str(lower * 2)
    origin = (
        f"train.groups_per_step = {groups_per_step} × source.group_size = {group_size}"
        if groups_per_step is not None
        else f"source.group_size = {group_size}"
    )
    raise AtroposConfigError(
        f"Atropos batch_size = {batch_size} sequences ({origin}): run-api forms a batch only from "
        f"groups whose sizes are powers of two dividing batch_size (it packs groups into bundles of "
        f"the largest group size); with group size {group_size} it may never form a batch, and it "
        f"says nothing: the trainer would wait forever. Set source.group_size to a power of two "
        f"({suggestion}) and make the environments send groups of that size."
    )


def _excerpt(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= BODY_EXCERPT_CHARS else text[:BODY_EXCERPT_CHARS] + "…"


class TrajectoryApiClient(SessionClient):
    """The trainer-side routes of run-api over one aiohttp session (`async with`).

    Every failure (refused connection, timeout, HTTP error, a body that is not the expected JSON)
    is one TrajectoryApiError naming the route.
    """

    def __init__(self, base_url: str, timeout_s: float) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    async def _request(self, method: str, route: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        if self._session is None:
            raise RuntimeError("TrajectoryApiClient used outside `async with`")
        try:
            async with self._session.request(
                method, self.base_url + route, json=body, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as reply:
                raw = await reply.read()
                status = reply.status
        except TimeoutError:
            raise TrajectoryApiError(route, None, f"no answer within {self.timeout_s}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise TrajectoryApiError(route, None, f"{type(exc).__name__}: {exc}") from None
        text = raw.decode("utf-8", errors="replace")
        if status != 200:
            raise TrajectoryApiError(route, status, _excerpt(text))
        try:
            data = json.loads(text)
        except ValueError:
            raise TrajectoryApiError(route, status, f"answer is not JSON: {_excerpt(text)}") from None
        if not isinstance(data, dict):
            raise TrajectoryApiError(route, status, f"expected a JSON object, got {_excerpt(text)}")
        return data

    async def register(self, registration: dict[str, Any]) -> dict[str, Any]:
        reply = await self._request("POST", "/register", registration)
        if "uuid" not in reply:
            raise TrajectoryApiError("/register", 200, f"no uuid in the answer: {_excerpt(str(reply))}")
        return reply

    async def info(self) -> dict[str, Any]:
        return await self._request("GET", "/info")

    async def status(self) -> dict[str, Any]:
        return await self._request("GET", "/status")

    async def batch(self) -> list[Any] | None:
        """The next batch's items, or None when the API has not formed one yet."""
        reply = await self._request("GET", "/batch")
        if reply.get("status") == "error":
            raise TrainerNotRegistered("/batch", 200, _excerpt(str(reply.get("message", reply))))
        batch = reply.get("batch", ...)
        if batch is None:
            return None
        if not isinstance(batch, list):
            raise TrajectoryApiError("/batch", 200, f"expected 'batch' to be a list or null: {_excerpt(str(reply))}")
        return batch


@dataclass
class Registration:
    """What grpod tells run-api about the run when it registers (besides the batch size)."""

    run_name: str
    max_token_len: int
    checkpoint_dir: Path
    checkpoint_every: int
    steps: int


@dataclass
class AtroposStats(SourceStats):
    """What `ctl status` shows of the source. `last_error` is the most recent failure and stays
    after recovery; `api_state` says whether the source is waiting on the API right now. The
    failure run (`failing_since`, `consecutive_errors`) is not ended by registering again, only
    by an answered `/batch`."""

    api_state: str = ApiState.STARTING.value
    registrations: int = 0
    batches: int = 0
    accepted_groups: int = 0
    accepted_sequences: int = 0
    pending_groups: int = 0
    empty_polls: int = 0
    api_errors: int = 0
    # Groups that declared no sampling temperature (trained at source.temperature).
    undeclared_temperature_groups: int = 0
    api_batch_size: int | None = None
    api_max_token_len: int | None = None
    api_step: int | None = None
    api_queue_size: int | None = None


class _Backoff:
    """A wait that starts at `first_s` and doubles after each use, up to `max_s`, until reset."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s = first_s
        self.max_s = max(max_s, first_s)
        self.next_s = first_s

    async def wait(self) -> None:
        seconds = self.next_s
        self.next_s = min(self.next_s * 2, self.max_s)
        await anyio.sleep(seconds)

    def reset(self) -> None:
        self.next_s = self.first_s


class AtroposSource:
    kind = "atropos"
    # `fill` loses nothing when cancelled: the batch request is shielded, its groups are pending
    # (in the cursor) until the buffer holds them, and the wait between polls is a sleep.
    fill_cancel_safe = True
    may_resend = True  # run-api forms batches LIFO and can hand a group out again

    def __init__(
        self,
        src: AtroposSourceConfig,
        policy: Policy,
        *,
        groups_per_step: int,
        registration: Registration,
        cursor: dict | None = None,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        rejections: RejectionCounter | None = None,
        progress: bool = True,
    ) -> None:
        self.src = src
        self.policy = policy
        self.run_info = registration
        self.progress = progress
        # The daemon's one rejection counter: conversion rejects count where validation's do
        # (`ctl status`, Prometheus).
        self.rejections = rejections if rejections is not None else RejectionCounter()
        self.group_size = src.group_size
        self.groups_per_step = groups_per_step
        self.batch_size = self.groups_per_step * self.group_size
        check_batch_geometry(self.batch_size, self.group_size, self.groups_per_step)
        self.url = src.atropos_url
        self.undeclared_temperature = src.temperature if src.atropos_undeclared_temperature == "config" else None
        self.request_timeout_s = request_timeout_s
        cursor = dict(cursor or {})
        if cursor.get("kind", self.kind) != self.kind:
            log.warning("source_cursor_ignored", kind=cursor.get("kind"), expected=self.kind)
            cursor = {}
        self.batches = int(cursor.get("batches", 0))
        self.step = int(cursor.get("starting_step", cursor.get("step", 0)))
        self._pending: deque[RolloutGroup] = deque(RolloutGroup.from_json(g) for g in cursor.get("pending", []))
        self.stats = AtroposStats(pending_groups=len(self._pending))
        self._registered = False
        self._state_since = time.monotonic()
        self._outage_since: float | None = None
        self._outage_errors = 0
        self._waiting_since = time.monotonic()
        self._last_waiting_line = self._waiting_since
        self._poll_wait = _Backoff(src.atropos_poll_s, MAX_WAIT_S)
        self._error_wait = _Backoff(src.atropos_poll_s, MAX_WAIT_S)

    def cursor(self) -> dict:
        cursor: dict[str, Any] = {"kind": self.kind, "batches": self.batches, "step": self.step}
        if self._pending:
            cursor["pending"] = [g.to_json() for g in self._pending]
        return cursor

    def registration(self) -> dict[str, Any]:
        """The body of `POST /register`; `starting_step` is the step this run has reached."""
        info = self.run_info
        return {
            "wandb_group": info.run_name,
            "wandb_project": "grpod",
            "batch_size": self.batch_size,
            "max_token_len": info.max_token_len,
            "checkpoint_dir": str(info.checkpoint_dir),
            "save_checkpoint_interval": info.checkpoint_every,
            "starting_step": self.step,
            "num_steps": info.steps,
        }

    # ---- the two ways the supervisor drives a source ---------------------------------------
    async def run(self, buffer: RolloutBuffer, may_generate: MayGenerate) -> None:
        """Keep fetching batches into `buffer` until cancelled (overlap mode).

        `may_generate` is awaited before every `GET /batch`: pausing the daemon stops pulling data
        from the API, which then keeps it queued.
        """
        async with TrajectoryApiClient(self.url, self.request_timeout_s) as api:
            while True:
                while self._pending:
                    if len(buffer) >= buffer.capacity:
                        self._enter(ApiState.BUFFER_FULL)
                    await self._put_next(buffer)
                await self._wait_for_room(buffer)
                await self._receive_batch(api, may_generate)

    async def evaluate(self, size: int, max_tokens: int) -> None:
        """Environments own their evaluation; grpod has no held-out data of theirs."""
        return None

    async def fill(self, buffer: RolloutBuffer, count: int) -> None:
        """Put `count` groups into `buffer` (the synchronous loop's path); waits for batches as long
        as it takes. Groups of a batch beyond `count` or beyond the buffer's room stay pending."""
        delivered = 0
        async with TrajectoryApiClient(self.url, self.request_timeout_s) as api:
            while delivered < count:
                if not self._pending:
                    await self._receive_batch(api, None)
                moved = 0
                while self._pending and delivered < count and len(buffer) < buffer.capacity:
                    await self._put_next(buffer)
                    moved += 1
                    delivered += 1
                if moved == 0 and self._pending:
                    return  # the buffer is full: nothing more can go in until the trainer takes some

    # ---- internals -------------------------------------------------------------------------
    async def _put_next(self, buffer: RolloutBuffer) -> None:
        await buffer.put(self._pending[0])
        self._pending.popleft()
        self.stats.pending_groups = len(self._pending)

    async def _wait_for_room(self, buffer: RolloutBuffer) -> None:
        need = min(self.groups_per_step, buffer.capacity)
        if buffer.capacity - len(buffer) < need:
            self._enter(ApiState.BUFFER_FULL)
            await buffer.wait_for_room(need)

    def _enter(self, state: ApiState, **why: Any) -> None:
        old = self.stats.api_state
        if old == state.value:
            return
        now = time.monotonic()
        pair = {old, state.value}
        routine = pair <= {ApiState.POLLING.value, ApiState.BUFFER_FULL.value} or (
            self._outage_since is not None and pair <= {ApiState.WAITING_FOR_API.value, ApiState.REGISTERING.value}
        )
        emit = log.debug if routine else log.info
        emit("atropos_state", **{"from": old, "to": state.value, "elapsed_s": round(now - self._state_since, 3)}, **why)
        self.stats.api_state = state.value
        self._state_since = now

    async def _api_failed(self, exc: TrajectoryApiError) -> None:
        """Show the failure, forget the registration (the API may come back empty), wait."""
        self._count_failure(str(exc))
        self._registered = False
        self._enter(ApiState.WAITING_FOR_API, error=str(exc)[:200])
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self._outage_errors = 0
            log.warning("atropos_api_unavailable", url=self.url, error=str(exc), retry_in_s=self._error_wait.next_s)
        self._outage_errors += 1
        self._say_still_waiting()
        await self._error_wait.wait()

    def _undeclared(self, group: RolloutGroup) -> None:
        self.stats.undeclared_temperature_groups += 1
        if self.stats.undeclared_temperature_groups == 1:
            log.warning("atropos_undeclared_temperature", group_id=group.group_id, temperature=group.temperature)
            self._console(
                f"Atropos groups declare no sampling temperature; they are trained at source.temperature = "
                f"{group.temperature:g} (counted in ctl status). Declare generation_params.temperature in the "
                'environment, or set source.atropos_undeclared_temperature = "refuse"'
            )

    def _console(self, text: str) -> None:
        if self.progress:
            print(f"grpod: {text}", file=sys.stderr, flush=True)

    def _say_still_waiting(self) -> None:
        now = time.monotonic()
        if now - self._last_waiting_line < WAITING_LINE_S:
            return
        self._last_waiting_line = now
        error = f"; last API error: {self.stats.last_error[:200]}" if self.stats.last_error else ""
        self._console(
            f"waiting for Atropos batches for {now - self._waiting_since:.0f} s (run-api at {self.url}: "
            f"step {self.stats.api_step}, {self.stats.api_queue_size} groups queued, a batch is "
            f"{self.batch_size} sequences){error}"
        )

    def _count_failure(self, error: str, *, api_error: bool = True) -> None:
        """One failed request: part of the current run of failures (`api_errors` counts requests
        that failed outright, not a run-api that forgot the trainer)."""
        self.stats.api_errors += int(api_error)
        self.stats.failing(error)

    async def _register(self, api: TrajectoryApiClient) -> None:
        self._enter(ApiState.REGISTERING)
        body = self.registration()
        reply = await api.register(body)
        info = await api.info()
        status = await api.status()
        self._registered = True
        self.stats.registrations += 1
        if self._outage_since is not None:
            log.info(
                "atropos_api_back",
                url=self.url,
                down_s=round(time.monotonic() - self._outage_since, 3),
                failed_attempts=self._outage_errors,
            )
            self._outage_since = None
        self.stats.api_batch_size = info.get("batch_size")
        self.stats.api_max_token_len = info.get("max_token_len")
        self._record_status(status)
        log.info(
            "atropos_registered",
            url=self.url,
            uuid=str(reply["uuid"]),
            batch_size=self.batch_size,
            starting_step=body["starting_step"],
            api_batch_size=self.stats.api_batch_size,
            api_step=self.stats.api_step,
            api_queue_size=self.stats.api_queue_size,
        )
        again = " again" if self.stats.registrations > 1 else ""
        self._console(
            f"registered{again} with run-api at {self.url} (batch of {self.batch_size} sequences = "
            f"train.groups_per_step {self.groups_per_step} x source.group_size {self.group_size}); "
            "waiting for environments to send scored groups"
        )
        if self.stats.api_batch_size != self.batch_size:
            self.stats.last_error = (
                f"run-api keeps batch_size {self.stats.api_batch_size} from an earlier registration, not "
                f"{self.batch_size}: its first registration wins. Restart run-api (or GET /reset_data) "
                f"to apply this run's train.groups_per_step × source.group_size"
            )
            log.warning("atropos_batch_size_mismatch", detail=self.stats.last_error)

    def _record_status(self, status: dict[str, Any]) -> None:
        self.stats.api_step = status.get("current_step")
        self.stats.api_queue_size = status.get("queue_size")

    async def _receive_batch(self, api: TrajectoryApiClient, may_generate) -> None:
        """Poll until one batch arrives and its groups are pending (registering as needed)."""
        while True:
            if may_generate is not None:
                await may_generate()
            try:
                if not self._registered:
                    await self._register(api)
                self._enter(ApiState.POLLING)
                # run-api forgets a batch once it is sent: finish the request even when cancelled.
                with anyio.CancelScope(shield=True):
                    items = await api.batch()
                    self.stats.succeeded()
                    if items is not None:
                        self._accept(items)
                        self._poll_wait.reset()
                        self._error_wait.reset()
                        return
                self._error_wait.reset()
                self.stats.empty_polls += 1
                self._say_still_waiting()
                self._record_status(await api.status())
            except TrainerNotRegistered as exc:
                log.warning("atropos_trainer_forgotten", url=self.url, detail=exc.detail)
                self._count_failure(str(exc), api_error=False)
                self._registered = False
                await self._error_wait.wait()
                continue
            except TrajectoryApiError as exc:
                await self._api_failed(exc)
                continue
            await self._poll_wait.wait()

    def _accept(self, items: list[Any]) -> None:
        """Convert one batch into pending groups, tagged with the version vLLM serves now."""
        version = self.policy.version
        self.batches += 1
        self.step += 1
        self.stats.batches += 1
        accepted = sequences = 0
        for i, item in enumerate(items):
            try:
                group = group_from_atropos(
                    item, default_version=version, group_id=f"atropos-{self.batches}-{i}",
                    undeclared_temperature=self.undeclared_temperature,
                )
            except MalformedGroup as exc:
                record_rejection(item, exc.rejection, self.rejections)
                continue
            if "temperature_from" in group.extra:
                self._undeclared(group)
            self._pending.append(group)
            accepted += 1
            sequences += group.size
        self._waiting_since = self._last_waiting_line = time.monotonic()
        self.stats.accepted_groups += accepted
        self.stats.accepted_sequences += sequences
        self.stats.pending_groups = len(self._pending)
        log.info(
            "atropos_batch_received",
            batch=self.batches,
            step=self.step,
            groups=len(items),
            accepted=accepted,
            rejected=len(items) - accepted,
            sequences=sequences,
            policy_version=version,
        )
