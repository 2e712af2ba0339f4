"""Holding up under load and outages: a bound on requests in flight (429 with Retry-After past it) and
503 JSON with Retry-After while the database is unreachable, logged once per outage.

Installed by `create_app`. Why a bound: every API handler that touches the database runs in the
thread pool and holds one pooled connection; past the pool's size requests queue inside SQLAlchemy
and time out as 500s, and a saturated thread pool also starves every other endpoint. The
`InflightLimit` middleware lets at most `limit` requests into the app at once (the rest wait up to
`queue_timeout_s` for a slot, then get 429), and never applies to /healthz, /readyz and /metrics, so
liveness keeps answering while the API is saturated. `create_app` sizes the thread pool and the
database pool from the same number.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.types import ASGIApp, Receive, Scope, Send

from deepfleet.controller.db.outage import Outage, is_connection_error

UNLIMITED_PATHS = ("/healthz", "/readyz", "/metrics")
RETRY_AFTER_BUSY_S = 1
RETRY_AFTER_DB_S = 5


class RequestGate:
    """At most `limit` requests inside the app (waiters beyond `queue_timeout_s` are answered 429); a URL
    with a NUL byte is answered 422 here (PostgreSQL cannot store or compare one)."""

    def __init__(self, app: ASGIApp, *, limit: int, queue_timeout_s: float) -> None:
        self.app = app
        self.limit = limit
        self.queue_timeout_s = queue_timeout_s
        self._slots: asyncio.Semaphore | None = None  # made on the server's event loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if b"%00" in scope.get("query_string", b"").lower() or "\x00" in scope["path"]:
            await _answer(send, 422, "invalid request", "(request): the URL contains a NUL byte; remove it")
            return
        if scope["path"] in UNLIMITED_PATHS:
            await self.app(scope, receive, send)
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout=self.queue_timeout_s)
        except TimeoutError:
            await _answer(send, 429, "server busy", "(request): the controller is at its request limit; retry "
                          f"after {RETRY_AFTER_BUSY_S} s", retry_after=RETRY_AFTER_BUSY_S)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self._slots.release()


async def _answer(send: Send, status: int, detail: str, error: str, *, retry_after: int | None = None) -> None:
    body = json.dumps({"detail": detail, "errors": [error]}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def install_outage_handler(app: FastAPI) -> None:
    """503 JSON + Retry-After for connection-level database errors (and pool exhaustion)."""
    app.state.outage = Outage()

    async def unavailable(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, DataError):  # a value the database cannot hold (range, encoding): the input's fault
            return JSONResponse({"detail": "invalid value", "errors": [
                "(request): a value is out of the range the database can store; use a smaller value"]},
                status_code=422)
        if isinstance(exc, DBAPIError) and not is_connection_error(exc):
            raise exc  # a real bug: let the server log it as one
        request.app.state.outage.failed(exc)
        return JSONResponse({"detail": "database unavailable", "errors": [
            f"(request): the controller's database does not answer; retry after {RETRY_AFTER_DB_S} s"]},
            status_code=503, headers={"Retry-After": str(RETRY_AFTER_DB_S)})

    app.add_exception_handler(OperationalError, unavailable)
    app.add_exception_handler(PoolTimeout, unavailable)
    app.add_exception_handler(DBAPIError, unavailable)

