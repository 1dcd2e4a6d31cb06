import json
import os
import socket
import stat
import time

import anyio
import pytest

from grpod.daemon.control import ControlError, ControlServer, UnsafeSocketPath, request


async def _echo(args):
    return {"echo": args}


async def _boom(args):
    raise RuntimeError("handler bug")


async def _refuse(args):
    raise ControlError("not now")


def _handlers():
    return {"status": _echo, "boom": _boom, "refuse": _refuse}


def _raw(path, payload: bytes) -> list[dict]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return [json.loads(line) for line in data.splitlines()]


def _with_server(tmp_path, fn):
    path = tmp_path / "run" / "grpod.sock"
    result = {}

    async def main():
        server = ControlServer(path, _handlers(), request_timeout_s=5)
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            result["value"] = await anyio.to_thread.run_sync(fn, path)
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert not path.exists(), "socket file removed on shutdown"
    return result["value"]


def test_socket_mode_0600_and_replies(tmp_path):
    def check(path):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        return request(path, "status", {"x": 1})

    reply = _with_server(tmp_path, check)
    assert reply == {"ok": True, "result": {"echo": {"x": 1}}}


def test_garbage_gets_error_replies_and_connection_survives(tmp_path):
    lines = (
        b"not json\n"
        b'{"cmd": 5}\n'
        b"[1,2]\n"
        b'{"cmd": "nope"}\n'
        b'{"cmd": "status", "args": [1]}\n'
        b'{"cmd": "boom"}\n'
        b'{"cmd": "refuse"}\n'
        b"\xff\xfe\n"
        b'{"cmd": "status"}\n'
    )
    replies = _with_server(tmp_path, lambda p: _raw(p, lines))
    assert len(replies) == 9
    assert [r["ok"] for r in replies] == [False] * 8 + [True]
    assert "malformed" in replies[0]["error"]
    assert "unknown command 'nope'" in replies[3]["error"]
    assert "args must be a JSON object" in replies[4]["error"]
    assert "internal error" in replies[5]["error"]
    assert replies[6]["error"] == "refuse: not now"


def test_overlong_line_is_refused(tmp_path):
    replies = _with_server(tmp_path, lambda p: _raw(p, b"x" * (200 * 1024) + b"\n" + b'{"cmd": "status"}\n'))
    assert replies[0]["ok"] is False and "longer than" in replies[0]["error"]
    assert replies[1]["ok"] is True and len(replies) == 2


def test_world_writable_directory_refused(tmp_path):
    public = tmp_path / "public"
    public.mkdir()
    os.chmod(public, 0o777)
    server = ControlServer(public / "grpod.sock", _handlers(), request_timeout_s=5)
    with pytest.raises(UnsafeSocketPath, match="world-writable"):
        anyio.run(server.serve)


def test_client_error_when_nobody_listens(tmp_path):
    with pytest.raises(ControlError, match="no grpod is listening"):
        request(tmp_path / "absent.sock", "status", timeout_s=2)


@pytest.mark.parametrize("ending", ["reset", "half_reply"])
def test_a_daemon_that_goes_away_mid_request_is_one_clear_error(tmp_path, ending):
    # Issue: `grpod ctl` printed a Python traceback when the daemon exited while answering.
    import socket as socket_module
    import threading
    import time

    from grpod.daemon.control import ControlError, request

    path = tmp_path / "s.sock"
    server = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def accept_and_go_away():
        conn, _ = server.accept()
        if ending == "half_reply":
            conn.recv(1024)
            conn.sendall(b'{"ok": tr\n')
        else:  # closing with the request unread resets the connection (ECONNRESET on Linux)
            time.sleep(0.2)
        conn.close()

    thread = threading.Thread(target=accept_and_go_away)
    thread.start()
    try:
        with pytest.raises(ControlError, match="grpod"):
            request(path, "status", timeout_s=10)
    finally:
        thread.join(10)
        server.close()


def test_hostile_lines_under_the_limit_get_error_replies(tmp_path):
    """Issue #30, 3: a 5000-digit integer and 30,000 nested brackets (60 KB, under MAX_LINE) killed
    the daemon through the server's task group; each is an error reply, and the connection goes on."""
    lines = (
        b'{"cmd": "set", "args": {"key": "train.lr", "value": ' + b"9" * 5000 + b"}}\n"
        + b"[" * 30000 + b"]" * 30000 + b"\n"
        + b'{"cmd": "status", "args": {"v": ' + b"[" * 20000 + b"]" * 20000 + b"}}\n"
        + b'{"cmd": "status"}\n'
    )
    replies = _with_server(tmp_path, lambda p: _raw(p, lines))
    assert [r["ok"] for r in replies] == [False, False, False, True], replies
    assert "Exceeds the limit" in replies[0]["error"]
    assert "nested too deeply" in replies[1]["error"] and "nested too deeply" in replies[2]["error"]


def test_a_reply_that_cannot_be_encoded_is_an_error_reply(tmp_path):
    async def huge(args):
        return {"value": 10**5000}

    path = tmp_path / "run" / "grpod.sock"
    result = {}

    async def main():
        server = ControlServer(path, {"status": huge}, request_timeout_s=5)
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            result["replies"] = await anyio.to_thread.run_sync(_raw, path, b'{"cmd": "status"}\n{"cmd": "status"}\n')
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert [r["ok"] for r in result["replies"]] == [False, False]
    assert "could not be encoded" in result["replies"][0]["error"]


def test_a_last_request_without_its_newline_is_answered(tmp_path):
    """`printf '{"cmd": "pause"}' | nc -U grpod.sock` sends no newline before it closes: the
    request is still carried out, not dropped unanswered."""
    replies = _with_server(tmp_path, lambda p: _raw(p, b'{"cmd": "status"}\n{"cmd": "status", "args": {"n": 2}}'))
    assert replies == [{"ok": True, "result": {"echo": {}}}, {"ok": True, "result": {"echo": {"n": 2}}}]


def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout(tmp_path):
    path = tmp_path / "run" / "grpod.sock"
    result = {}

    def idle_then_ask(path):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(path))
            result["closed_by_server"] = s.recv(1024) == b""  # blocks until the server closes it
        return request(path, "status")

    async def main():
        server = ControlServer(path, _handlers(), request_timeout_s=5)
        server.idle_timeout_s = 0.5
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            result["reply"] = await anyio.to_thread.run_sync(idle_then_ask, path)
            with anyio.fail_after(5):  # the reply's connection, closed by the client, is let go
                while server.connections:
                    await anyio.sleep(0.01)
            result["open"] = server.connections
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert result["closed_by_server"] and result["reply"]["ok"] and result["open"] == 0


def test_a_connection_that_never_reads_its_replies_is_closed_after_the_idle_timeout(tmp_path):
    """A client that sends requests and never reads: the reply's send blocked forever once the
    socket's buffers filled, holding the connection (128 such filled the cap; even `ctl stop` was
    turned away). Now the send is bounded by the idle timeout and the connection closed."""
    path = tmp_path / "run" / "grpod.sock"
    result = {}

    async def big(args):
        return {"blob": "x" * 8192}

    def flood(path) -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(str(path))
        s.setblocking(False)
        try:
            for _ in range(1000):
                s.send(b'{"cmd": "status"}\n')
        except BlockingIOError:
            pass  # the server stopped reading: its reply's send is blocked
        return s

    async def main():
        server = ControlServer(path, {"status": big}, request_timeout_s=5)
        server.idle_timeout_s = 0.5
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            unread = await anyio.to_thread.run_sync(flood, path)
            try:
                with anyio.fail_after(5):
                    while not server.requests:  # accepted and being served
                        await anyio.sleep(0.01)
                with anyio.move_on_after(10):
                    while server.connections:
                        await anyio.sleep(0.05)
                result["open"] = server.connections
                result["after"] = await anyio.to_thread.run_sync(request, path, "status")
            finally:
                unread.close()
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert result["open"] == 0, "the connection that never reads is let go"
    assert result["after"]["ok"]


def test_connections_over_the_limit_are_turned_away_with_a_reason(tmp_path):
    """Issue: 1100 idle connections ended the daemon (`run_failed reason='BrokenResourceError: '`)."""
    from grpod.daemon.control import MAX_CONNECTIONS

    def crowd(path):
        held = []
        try:
            for _ in range(MAX_CONNECTIONS):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(str(path))
                held.append(s)
            time.sleep(0.5)  # all accepted and counted
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as extra:
                extra.settimeout(10)
                extra.connect(str(path))
                refused = json.loads(extra.recv(65536))
        finally:
            for s in held:
                s.close()
        time.sleep(0.5)
        return refused, request(path, "status", {"after": True})

    refused, after = _with_server(tmp_path, crowd)
    assert refused["ok"] is False and f"at most {MAX_CONNECTIONS}" in refused["error"]
    assert after == {"ok": True, "result": {"echo": {"after": True}}}


SERVE_WITH_FEW_DESCRIPTORS = """
import resource, sys
from pathlib import Path
import anyio
from grpod.daemon.control import ControlServer

resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

async def status(args):
    return {"alive": True}

async def main():
    server = ControlServer(Path(sys.argv[1]), {"status": status}, request_timeout_s=5)
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        print("listening", file=sys.stderr, flush=True)
        await anyio.sleep(120)
        raise SystemExit(3)

anyio.run(main)
"""


def test_a_server_out_of_file_descriptors_goes_on_serving(tmp_path):
    """The process's descriptors run out (RLIMIT_NOFILE 64, 100 connections held): accept fails
    with EMFILE, which is logged and retried, never the end of the server."""
    import subprocess
    import sys

    path = tmp_path / "run" / "grpod.sock"
    child = subprocess.Popen([sys.executable, "-c", SERVE_WITH_FEW_DESCRIPTORS, str(path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stderr.readline().strip() == "listening"
        held = []
        for _ in range(100):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(path))
            held.append(s)
        time.sleep(2)
        assert child.poll() is None, child.stderr.read()
        for s in held:
            s.close()
        assert request(path, "status", timeout_s=20) == {"ok": True, "result": {"alive": True}}
        assert child.poll() is None
    finally:
        child.kill()
        out, _ = child.communicate(timeout=30)
    assert "control_accept_failed" in out and "Too many open files" in out
