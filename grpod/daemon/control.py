"""The control socket: newline-delimited JSON over a Unix socket in the run directory.

Request:  {"cmd": "status" | "pause" | "resume" | "sync" | "checkpoint" | "drain" | "stop" | ..., "args": {...}}
Reply:    {"ok": true, "result": {...}}  or  {"ok": false, "error": "what was wrong"}

The socket is created with mode 0600 inside a directory that is not world-writable. A malformed
line, an unknown command or bad arguments gets an error reply and changes nothing; a handler that
raises is answered with its message and never takes the daemon down. Each connection may send
many requests; each line is answered in order.

No request line, however malformed, ends the daemon: `decode_request` turns every way a line can
fail to decode into an error reply — invalid UTF-8, invalid JSON, an integer longer than Python
converts (`ValueError: Exceeds the limit (4300 digits)`), nesting deeper than the decoder recurses
(`RecursionError`: 30,000 brackets fit in one line) — and a connection whose handling fails in any
other way is logged and closed, never propagated into the server's task group.

Nor does a crowd of connections: at most `MAX_CONNECTIONS` are served at once (the next one is
answered with an error and closed), a connection that sends nothing for `IDLE_TIMEOUT_S` is
closed, so is one that reads no reply for as long (its sends fill the socket's buffers), and an accept that fails because the process is out of file descriptors is logged and
retried after `ACCEPT_RETRY_S`, while training goes on.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from grpod.service.logs import json_ready

log = structlog.get_logger(__name__)

MAX_LINE = 64 * 1024
MAX_CONNECTIONS = 128
IDLE_TIMEOUT_S = 300.0
ACCEPT_RETRY_S = 0.5
# What accept() fails with while the process or the system is out of descriptors or buffers.
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class ControlError(Exception):
    """A request the daemon refuses; the message is sent back to the caller."""


class UnsafeSocketPath(Exception):
    """The socket would be reachable by other users."""


def check_socket_dir(path: Path) -> None:
    parent = path.parent
    mode = parent.stat().st_mode
    if mode & stat.S_IWOTH:
        raise UnsafeSocketPath(
            f"control socket {path}: directory {parent} is world-writable "
            f"(mode {stat.S_IMODE(mode):o}); put the socket in a private directory (e.g. the run directory)"
        )


async def _read_lines(stream: SocketStream, idle_timeout_s: float):
    """Yield each request line; an over-long line yields None once and is skipped to its end; a
    last line closed without its newline is still a request. Ends when the peer closes, or when
    it sends nothing for `idle_timeout_s`."""
    buffered = BufferedByteReceiveStream(stream)
    try:
        while True:
            last = False  # the peer closed after a line without its newline
            with anyio.move_on_after(idle_timeout_s) as idle:  # (no yield inside the scope)
                try:
                    line = await buffered.receive_until(b"\n", MAX_LINE)
                except anyio.DelimiterNotFound:
                    line = None
                except anyio.IncompleteRead:
                    line, last = bytes(buffered.buffer), True
            if idle.cancelled_caught:
                log.info("control_connection_idle", idle_timeout_s=idle_timeout_s)
                return
            if last:
                if line.strip():
                    yield line
                return
            yield line
            if line is None:
                while True:  # discard the rest of that line
                    with anyio.fail_after(idle_timeout_s):
                        chunk = await buffered.receive(MAX_LINE)
                    end = chunk.find(b"\n")
                    if end >= 0:
                        buffered.feed_data(chunk[end + 1 :])
                        break
    except (TimeoutError, anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
        return


class ControlServer:
    def __init__(self, path: Path, handlers: dict[str, Handler], request_timeout_s: float) -> None:
        self.path = path
        self.handlers = handlers
        self.request_timeout_s = request_timeout_s
        self.requests = 0
        self.errors = 0
        self.connections = 0
        self.idle_timeout_s = IDLE_TIMEOUT_S

    async def dispatch(self, line: bytes | None) -> dict[str, Any]:
        self.requests += 1
        if line is None:
            return {"ok": False, "error": f"request longer than {MAX_LINE} bytes"}
        try:
            request = decode_request(line)
        except ControlError as exc:
            return {"ok": False, "error": str(exc)}
        if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
            return {"ok": False, "error": 'malformed request: expected {"cmd": NAME, "args": {...}}'}
        cmd = request["cmd"]
        args = request.get("args") or {}
        if not isinstance(args, dict):
            return {"ok": False, "error": f"{cmd}: args must be a JSON object"}
        handler = self.handlers.get(cmd)
        if handler is None:
            known = ", ".join(sorted(self.handlers))
            return {"ok": False, "error": f"unknown command {cmd!r}; known: {known}"}
        try:
            with anyio.fail_after(self.request_timeout_s):
                result = await handler(args)
        except ControlError as exc:
            return {"ok": False, "error": f"{cmd}: {exc}"}
        except TimeoutError:
            return {"ok": False, "error": f"{cmd}: no answer within {self.request_timeout_s}s"}
        except Exception as exc:  # noqa: BLE001 — a handler bug must not kill the daemon
            self.errors += 1
            log.exception("control_handler_failed", cmd=cmd)
            return {"ok": False, "error": f"{cmd}: internal error: {exc!r}"}
        return {"ok": True, "result": result}

    async def _serve_one(self, stream: SocketStream) -> None:
        """One connection's requests, in order (counted in `connections` by the accept loop)."""
        try:
            async with stream:
                async for line in _read_lines(stream, self.idle_timeout_s):
                    if line is not None and not line.strip():
                        continue
                    reply = encode_reply(await self.dispatch(line))
                    try:
                        with anyio.fail_after(self.idle_timeout_s):
                            await stream.send(reply)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                        return
                    except TimeoutError:  # the client sends requests and reads no replies
                        log.warning("control_connection_unread", idle_timeout_s=self.idle_timeout_s)
                        return
        except Exception:  # noqa: BLE001 — one connection's failure is never the daemon's
            self.errors += 1
            log.exception("control_connection_failed")
        finally:
            self.connections -= 1

    async def _turn_away(self, stream: SocketStream) -> None:
        """Answer a connection over `MAX_CONNECTIONS` with the reason, and close it."""
        self.errors += 1
        log.warning("control_connection_refused", open=self.connections, limit=MAX_CONNECTIONS)
        with anyio.move_on_after(1.0):
            try:
                await stream.send(encode_reply({"ok": False, "error": f"{self.connections} control connections are open "
                                                f"(at most {MAX_CONNECTIONS}); try again"}))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
        await stream.aclose()

    async def _accept_loop(self, listener) -> None:
        async with anyio.create_task_group() as tg:
            while True:
                try:
                    stream = await listener.accept()
                except anyio.BrokenResourceError as exc:
                    cause = exc.__cause__
                    if not isinstance(cause, OSError) or cause.errno not in _EXHAUSTED:
                        raise
                    self.errors += 1
                    log.warning("control_accept_failed", error=os.strerror(cause.errno), open=self.connections,
                                retry_s=ACCEPT_RETRY_S)
                    await anyio.sleep(ACCEPT_RETRY_S)
                    continue
                if self.connections >= MAX_CONNECTIONS:
                    tg.start_soon(self._turn_away, stream)
                else:
                    self.connections += 1
                    tg.start_soon(self._serve_one, stream)

    async def serve(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        check_socket_dir(self.path)
        if self.path.exists() or self.path.is_symlink():
            if socket_alive(self.path):
                raise UnsafeSocketPath(f"control socket {self.path} is in use by another running grpod")
            self.path.unlink()
        old = os.umask(0o177)
        try:
            listener = await anyio.create_unix_listener(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        log.info("control_listening", socket=str(self.path))
        task_status.started()
        try:
            async with listener:
                await self._accept_loop(listener)
        finally:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


def decode_request(line: bytes) -> Any:
    """One request line as JSON; ControlError saying what is wrong with it otherwise."""
    try:
        return json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ControlError(f"malformed request: not a JSON line ({exc})") from None
    except RecursionError:
        raise ControlError("malformed request: JSON nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than int() converts
        raise ControlError(f"malformed request: {str(exc)[:200]}") from None


def encode_reply(reply: dict[str, Any]) -> bytes:
    """A reply as one JSON line; a reply that cannot be encoded becomes an error reply."""
    try:
        return (json.dumps(json_ready(reply), default=str) + "\n").encode()
    except (ValueError, TypeError, RecursionError) as exc:
        error = {"ok": False, "error": f"the reply could not be encoded: {type(exc).__name__}: {str(exc)[:200]}"}
        return (json.dumps(error) + "\n").encode()


def socket_alive(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def request(path: Path, cmd: str, args: dict[str, Any] | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
    """Send one request and wait for its reply (blocking; used by `grpod ctl`)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ControlError(f"no grpod is listening on {path} ({exc.strerror})") from None
        sock.sendall((json.dumps({"cmd": cmd, "args": args or {}}) + "\n").encode())
        buffer = b""
        while b"\n" not in buffer:
            chunk = sock.recv(65536)
            if not chunk:
                raise ControlError(f"grpod closed the connection on {path} without replying")
            buffer += chunk
        try:
            return json.loads(buffer.split(b"\n", 1)[0])
        except json.JSONDecodeError:
            raise ControlError(f"grpod on {path} sent a reply that is not JSON: {buffer[:80]!r}") from None
    except TimeoutError:
        raise ControlError(f"no reply from {path} within {timeout_s}s") from None
    except OSError as exc:  # reset / broken pipe: the daemon went away mid-request
        raise ControlError(f"lost the connection to grpod on {path} ({exc.strerror or exc}); did it exit?") from None
    finally:
        sock.close()
