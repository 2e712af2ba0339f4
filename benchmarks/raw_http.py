"""A lean HTTP/1.1 keep-alive client on asyncio streams, for load benchmarks that share a small machine
with the server they measure.

Why not httpx alone: on a 2-core machine an httpx request costs about 1.5 ms of client CPU, a quarter of
what the controller spends answering a submit, and every millisecond the load generator burns is taken
from the server under test (in production the clients are elsewhere). This client does only what the
benchmarks need: a pool of persistent connections to one host, requests with a body, responses with
`Content-Length` or chunked bodies. Anything else (redirects, TLS, proxies, cookies) is httpx's job.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlencode


class TransportError(Exception):
    """The connection failed or was closed before a whole response arrived."""


class Response:
    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code, self.headers, self.content = status_code, headers, content

    def raise_for_status(self) -> None:
        if self.status_code >= 400:
            raise RuntimeError(f"HTTP {self.status_code}: {self.content[:200]!r}")


class RawClient:
    """Requests to `http://host:port` over at most `connections` persistent connections."""

    def __init__(self, host: str, port: int, *, headers: dict[str, str] | None = None, connections: int = 64) -> None:
        self.host, self.port, self.connections = host, port, connections
        self._default = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(connections)

    async def __aenter__(self) -> RawClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()

    async def get(self, path: str, params: dict | None = None) -> Response:
        return await self.request("GET", path + ("?" + urlencode(params) if params else ""))

    async def post(self, path: str, content: str | bytes = b"", headers: dict[str, str] | None = None) -> Response:
        return await self.request("POST", path, content, headers)

    async def request(self, method: str, path: str, body: str | bytes = b"",
                      headers: dict[str, str] | None = None) -> Response:
        data = body.encode() if isinstance(body, str) else body
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self._default}{extra}"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        async with self._slots:
            conn = self._idle.pop() if self._idle else await self._connect()
            reader, writer = conn
            try:
                writer.write(head + data)
                response, keep = await _read_response(reader)
            except (OSError, asyncio.IncompleteReadError, ValueError) as e:
                writer.close()
                raise TransportError(f"{method} {path}: {e!r}") from e
            if keep:
                self._idle.append(conn)
            else:
                writer.close()
            return response

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        except OSError as e:
            raise TransportError(f"connect {self.host}:{self.port}: {e!r}") from e


async def _read_response(reader: asyncio.StreamReader) -> tuple[Response, bool]:
    status_line = await reader.readuntil(b"\r\n")
    if not status_line:
        raise asyncio.IncompleteReadError(b"", None)
    status = int(status_line.split(b" ", 2)[1])
    headers: dict[str, str] = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while (size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)) > 0:
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
            pass
        content = b"".join(parts)
    else:
        content = await reader.readexactly(int(headers.get("content-length", "0")))
    return Response(status, headers, content), headers.get("connection", "").lower() != "close"
