"""The load benchmarks' lean HTTP client: sized and chunked bodies, connection reuse, and a server that
closes or resets is a TransportError, never a hang or a wrong body."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.raw_http import RawClient, TransportError


async def _serve(handler):  # noqa: ANN001, ANN202
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # port 0: the kernel picks, no race
    return server, server.sockets[0].getsockname()[1]


async def _request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    size = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head, await reader.readexactly(size)


def test_sized_and_chunked_bodies_over_one_reused_connection() -> None:
    connections, seen = [], []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        for answer in (b"HTTP/1.1 201 Created\r\nContent-Length: 5\r\n\r\nhello",
                       b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=1\r\nde\r\n0\r\n\r\n",
                       b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno"):
            head, body = await _request(reader)
            seen.append((head.split(b"\r\n")[0], body))
            writer.write(answer)
            await writer.drain()
        writer.close()

    async def main() -> list:
        server, port = await _serve(handler)
        async with server, RawClient("127.0.0.1", port, headers={"Authorization": "Bearer t"}, connections=4) as c:
            a = await c.post("/v1/jobs", content="kind: x", headers={"Content-Type": "application/yaml"})
            b = await c.get("/v1/jobs", params={"limit": 50})
            d = await c.get("/healthz")
            return [(r.status_code, r.content) for r in (a, b, d)]

    assert asyncio.run(main()) == [(201, b"hello"), (200, b"abcde"), (503, b"no")]
    assert seen == [(b"POST /v1/jobs HTTP/1.1", b"kind: x"), (b"GET /v1/jobs?limit=50 HTTP/1.1", b""),
                    (b"GET /healthz HTTP/1.1", b"")]
    assert len(connections) == 1  # keep-alive: one connection for all three


def test_a_connection_closed_mid_response_is_a_transport_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort")
        await writer.drain()
        writer.close()

    async def main() -> None:
        server, port = await _serve(handler)
        async with server, RawClient("127.0.0.1", port) as c:
            await c.get("/")

    with pytest.raises(TransportError, match="GET /"):
        asyncio.run(main())
