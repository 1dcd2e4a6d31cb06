"""The one way grpod's HTTP clients hold their connection: an aiohttp session opened by `async
with`, carrying `Authorization: Bearer <secret>` on every request when a secret is given (vLLM's
API key, an agent's token), and the one shape of a failed request (`RequestError`). Each client
(vLLM, an agent, Atropos' trajectory API) adds its routes and names its server in its error type."""

from __future__ import annotations

from typing import Self

import aiohttp


class SessionClient:
    def __init__(self, bearer: str | None = None) -> None:
        self._headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
        self._session = aiohttp.ClientSession(headers=self._headers)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class RequestError(RuntimeError):
    """A request to a server failed; `status` is None when no HTTP answer came back. Subclasses
    name the server (`server`); the message reads "<server> <route>: HTTP 500: <detail>"."""

    server = "server"

    def __init__(self, route: str, status: int | None, detail: str) -> None:
        self.route = route
        self.status = status
        self.detail = detail
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"{self.where()} {route}: {where}: {detail}")

    def where(self) -> str:
        return self.server

