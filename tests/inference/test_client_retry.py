"""The client's one retry of a request whose connection was reset before any answer.

A real vLLM resets such a request only in a race (its keep-alive timeout expiring while our
request is in flight, e.g. after a stall), so a small TCP server plays it: it resets the first
connection after reading the request, and answers on the next.
"""

from __future__ import annotations

import socket
import struct

import anyio
import pytest

from grpod.inference.client import InferenceClient, InferenceRequestError

ANSWER = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 20\r\n\r\n{"status": "paused"}'


def _handler(resets: int, seen: list[bytes]):
    async def handle(conn) -> None:
        async with conn:
            request = await conn.receive(65536)
            seen.append(request.split(b"\r\n", 1)[0])
            if len(seen) <= resets:
                raw = conn.extra(anyio.abc.SocketAttribute.raw_socket)
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
                return
            await conn.send(ANSWER)

    return handle


@pytest.mark.parametrize("resets, ok", [(1, True), (2, False)])
def test_a_reset_request_is_sent_once_more_and_only_once(resets, ok):
    async def main():
        seen: list[bytes] = []
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        port = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, _handler(resets, seen))
            async with InferenceClient(f"http://127.0.0.1:{port}", 10.0) as client:
                try:
                    await client.pause("keep")
                    error = None
                except InferenceRequestError as exc:
                    error = exc
            tg.cancel_scope.cancel()
        return seen, error

    seen, error = anyio.run(main)
    assert seen == [b"POST /grpod/pause?mode=keep HTTP/1.1"] * min(resets + 1, 2)
    assert (error is None) is ok
    if not ok:
        assert error.status is None and "/grpod/pause" in str(error)


def test_a_refused_connection_is_not_retried():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed

    async def main():
        async with InferenceClient(f"http://127.0.0.1:{port}", 5.0) as client:
            with pytest.raises(InferenceRequestError, match="ClientConnectorError"):
                await client.pause("keep")

    anyio.run(main)
