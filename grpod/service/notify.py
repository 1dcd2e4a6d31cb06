"""systemd's notify protocol (sd_notify), spoken directly over the datagram socket.

`Type=notify` services tell systemd READY=1, STATUS=..., WATCHDOG=1 and STOPPING=1 by sending
newline-separated assignments as one datagram to the socket named in $NOTIFY_SOCKET (a path, or
an abstract name written with a leading '@'). Outside systemd the variable is unset and every call
is a no-op. The watchdog interval comes from $WATCHDOG_USEC; grpod pings at half of it, and only
while training makes progress (see `Heartbeat`).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

log = structlog.get_logger(__name__)


class SystemdNotifier:
    def __init__(self, address: str | None = None) -> None:
        self.address = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def _target(self) -> str | bytes:
        assert self.address
        if self.address.startswith("@"):
            return "\0" + self.address[1:]
        return self.address

    def send(self, **fields: str | int) -> bool:
        """Send one datagram of KEY=VALUE lines; False (logged) when it could not be delivered."""
        if self._sock is None:
            return False
        payload = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            self._sock.sendto(payload, self._target())
        except OSError as exc:
            log.warning("notify_failed", address=self.address, error=str(exc))
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status)

    def status(self, text: str) -> bool:
        return self.send(STATUS=text)

    def stopping(self, status: str = "stopping") -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval_s() -> float | None:
    """Half of $WATCHDOG_USEC when systemd set a watchdog for this very process, else None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec) / 2_000_000, 0.05)
    except ValueError:
        return None


class Heartbeat:
    """Tracks training progress; the watchdog pings only while progress is recent.

    `busy()` marks the start of a unit of work of the step loop that must finish (a step, a
    sync); `progress()` marks its end. Work that runs beside the loop (a pipelined sync's vLLM
    half) is held in `running()`. The heartbeat is healthy when nothing is running, or when the
    oldest unit running started less than `stall_after_s` ago. A hung step or sync therefore
    stops WATCHDOG=1 and systemd restarts the service.
    """

    def __init__(self, stall_after_s: float) -> None:
        self.stall_after_s = stall_after_s
        self.last_progress = time.monotonic()
        self.busy_since: float | None = None
        self.last_ping: float | None = None
        self._beside: dict[object, float] = {}

    def busy(self) -> None:
        self.busy_since = time.monotonic()

    def progress(self) -> None:
        self.busy_since = None
        self.last_progress = time.monotonic()

    @contextmanager
    def running(self) -> Iterator[None]:
        """A unit of work running beside the step loop, from entry to exit."""
        key = object()
        self._beside[key] = time.monotonic()
        try:
            yield
        finally:
            del self._beside[key]
            self.last_progress = time.monotonic()

    def _oldest_start(self) -> float | None:
        starts = [t for t in (self.busy_since, *self._beside.values()) if t is not None]
        return min(starts, default=None)

    def healthy(self) -> bool:
        oldest = self._oldest_start()
        return oldest is None or time.monotonic() - oldest < self.stall_after_s

    def describe(self) -> dict:
        now = time.monotonic()
        oldest = self._oldest_start()
        return {
            "last_progress_age_s": round(now - self.last_progress, 3),
            "busy_for_s": None if oldest is None else round(now - oldest, 3),
            "last_heartbeat_age_s": None if self.last_ping is None else round(now - self.last_ping, 3),
            "healthy": self.healthy(),
        }
