import json
import os
import socket
import stat

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
