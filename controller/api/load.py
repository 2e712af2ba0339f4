"""Holding up under load and outages: a bound on requests in flight (429 with Retry-After past it) and
503 JSON with Retry-After while the database is unreachable, logged once per outage.

Installed by `create_app`. Why a bound: every API handler that touches the database runs in the
thread pool and holds one pooled connection; past the pool's size requests queue inside SQLAlchemy
and time out as 500s, and a saturated thread pool also starves every other endpoint. The
`RequestGate` middleware lets at most `limit` requests into the app at once (the rest wait up to
`queue_timeout_s` for a slot, reads before writes, then get 429), and never applies to /healthz, /readyz
and /metrics, so liveness keeps answering while the API is saturated; a saturated process also closes
the keep-alive connections it answers, so their clients reconnect to a less busy process. `create_app` sizes the thread pool and the
database pool from the same number.

Also how the API is served: `serve` (uvicorn on an inherited socket or host:port) and `ApiProcesses`,
the extra processes that answer the API on the same socket when one process's core is not enough.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepfleet.controller.db.outage import Outage, is_connection_error

log = logging.getLogger("deepfleet.controller")
UNLIMITED_PATHS = ("/healthz", "/readyz", "/metrics")
RETRY_AFTER_BUSY_S = 1
RETRY_AFTER_DB_S = 5


class RequestGate:
    """At most `limit` requests inside the app (waiters beyond `queue_timeout_s` are answered 429); a URL
    with a NUL byte is answered 422 here (PostgreSQL cannot store or compare one).

    Reads go first: a freed slot passes to the oldest waiting GET before any waiting write, so listings
    and job details do not queue behind submits (whose parsing costs several times a read's CPU). Writes
    are not starved: while they wait, every `limit + 1`-th freed slot is theirs, and like any request a
    write waits at most `queue_timeout_s`.

    With `shed` (one of several API processes), a saturated process sheds connections: while requests
    wait for a slot, each answer it sends closes its keep-alive connection (`Connection: close`), so that
    client's next request connects anew and the kernel hands it to whichever API process accepts first,
    the least busy one (see `ApiProcesses`). Without it, connections stay where they first landed: an
    event loop accepts every pending connection at once, so one process of several held every client of
    a burst for as long as they stayed (all the reads and submits of `benchmarks/controller_load.py`)."""

    def __init__(self, app: ASGIApp, *, limit: int, queue_timeout_s: float, shed: bool = False) -> None:
        self.app = app
        self.limit = limit
        self.queue_timeout_s = queue_timeout_s
        self.shed = shed
        self._free = limit
        # Futures of the requests waiting for a slot (made on the server's event loop, where they wait).
        self._reads: deque[asyncio.Future[None]] = deque()
        self._writes: deque[asyncio.Future[None]] = deque()
        self._reads_first = 0  # slots passed to reads in a row while writes waited

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
        if not await self._acquire(self._reads if scope["method"] in ("GET", "HEAD") else self._writes):
            await _answer(send, 429, "server busy", "(request): the controller is at its request limit; retry "
                          f"after {RETRY_AFTER_BUSY_S} s", retry_after=RETRY_AFTER_BUSY_S)
            return

        async def shedding(message: Message) -> None:
            if message["type"] == "http.response.start" and self.shed and (self._reads or self._writes):
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, receive, shedding)
        finally:
            self._release()

    async def _acquire(self, queue: deque[asyncio.Future[None]]) -> bool:
        """A slot for this request (True), or False after `queue_timeout_s`. Slots pass from a finished
        request straight to a waiter (`_release`), so a free slot means nobody waits. Only the event loop
        resolves a waiter (a slot, or the timeout), so the two cannot both reach one."""
        if self._free > 0:
            self._free -= 1
            return True
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        queue.append(waiter)
        timer = loop.call_later(self.queue_timeout_s, _expire, waiter)
        try:
            await waiter
        except TimeoutError:
            return False
        except BaseException:  # cancelled (the client left, shutdown) after a slot was handed over: pass it on
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._release()
            raise
        finally:
            timer.cancel()
        return True

    def _release(self) -> None:
        _drop_done(self._reads)
        _drop_done(self._writes)
        if self._reads and not (self._writes and self._reads_first >= self.limit):
            self._reads_first = self._reads_first + 1 if self._writes else 0
            self._reads.popleft().set_result(None)  # the slot passes to it
        elif self._writes:
            self._reads_first = 0
            self._writes.popleft().set_result(None)
        else:
            self._free += 1


def _drop_done(queue: deque[asyncio.Future[None]]) -> None:
    """Drop the waiters that gave up (timed out or cancelled) from the head of `queue`."""
    while queue and queue[0].done():
        queue.popleft()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())  # `_release` skips it


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


# Seconds an idle keep-alive connection stays open. uvicorn's default (5 s) races clients that reuse a
# pooled connection just as the server closes it (the client sees a reset on a request it already sent);
# past any client pool's idle timeout and any load balancer's (60 s is the common default), it cannot.
KEEP_ALIVE_S = 75


def inherited_socket(fd: int) -> socket.socket:
    """The listening socket a parent handed over as `fd`, opened with its real family.

    uvicorn's own `fd=` path labels every such socket AF_UNIX, so asyncio never sets TCP_NODELAY on
    the TCP connections it accepts, and each response whose headers and body leave in two segments
    then waits out the client's delayed ACK (about 40 ms per request)."""
    return socket.socket(fileno=fd)


class FreezeAfterStartup:
    """Once the app's start-up is done, everything that exists (modules, settings, the app, the engine
    config's models) lives as long as the process: `gc.freeze()` then takes it out of the garbage
    collector's reach, so a full collection walks only what requests made since. It walked all of it,
    in 35-70 ms pauses during which every request of the process waited (measured under
    `benchmarks/controller_load.py`). Applied by `serve`, once per serving process (not in tests, where
    an app's objects are garbage after the test)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return

        async def started(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                gc.collect()
                gc.freeze()
            await send(message)

        await self.app(scope, receive, started)


def serve(app: ASGIApp, *, fd: int | None = None, host: str = "127.0.0.1", port: int = 8000,
          **options: Any) -> None:
    """Run `app` under uvicorn on an inherited listening socket `fd`, else on host:port (the objects of
    its start-up frozen out of the garbage collector's reach, see `FreezeAfterStartup`)."""
    import uvicorn

    config = uvicorn.Config(FreezeAfterStartup(app), host=host, port=port, timeout_keep_alive=KEEP_ALIVE_S,
                            **options)
    try:
        uvicorn.Server(config).run(sockets=[inherited_socket(fd)] if fd is not None else None)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on: a clean stop, not a traceback
        pass


PARENT_ENV = "DEEPFLEET_API_PARENT_PID"
"""Set for an extra API process: the pid of the server that started it (see `exit_with_parent`)."""


def exit_with_parent() -> None:
    """In an extra API process: stop (SIGTERM to itself) once the server that started it is gone, even
    killed outright or before this process got this far, so no orphan keeps answering on the socket."""
    parent = int(os.environ.get(PARENT_ENV) or os.getppid())

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class ApiProcesses:
    """More processes answering the API on one listening socket: one Python process runs requests on one
    core (the GIL), so a busy controller on a multi-core host spreads them over `count` extra processes
    that accept from the same socket (the kernel hands each connection to one of them).

    `command` starts one extra process serving the API alone on the inherited socket (no reconcilers:
    those run once, in this process). Started after this process's start-up (migrations, bootstrap
    token) and stopped before its shutdown; one that exits is started again after `restart_delay_s`.
    """

    def __init__(self, command: list[str], *, count: int, fd: int, restart_delay_s: float = 1.0) -> None:
        self.command, self.count, self.fd, self.restart_delay_s = command, count, fd, restart_delay_s
        self.processes: list[subprocess.Popen[bytes]] = []
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        self.processes = [self._spawn() for _ in range(self.count)]
        self._watcher = threading.Thread(target=self._watch, name="api-processes", daemon=True)
        self._watcher.start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command, pass_fds=(self.fd,), env={**os.environ, PARENT_ENV: str(os.getpid())})

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            for i, proc in enumerate(self.processes):
                code = proc.poll()
                # 0 and death by SIGTERM/SIGINT are a shutdown (a Ctrl-C reaches the whole group).
                if code is not None and code not in (0, -signal.SIGTERM, -signal.SIGINT) \
                        and not self._stop.is_set():
                    log.warning("API process %d exited with %s; starting it again", proc.pid, proc.returncode)
                    if self._stop.wait(self.restart_delay_s):
                        return
                    self.processes[i] = self._spawn()

    def stop(self, timeout_s: float = 15.0) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def with_api_processes(app: FastAPI, processes: ApiProcesses) -> FastAPI:
    """`app` whose lifespan also runs `processes` (after its own start-up, stopped before its shutdown)."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[None]:
        async with inner(a):
            processes.start()
            try:
                yield
            finally:
                await asyncio.to_thread(processes.stop)

    app.router.lifespan_context = lifespan
    app.state.api_processes = processes
    return app


def per_process_limit(total: int, processes: int) -> int:
    """Each API process's share of `max_inflight_requests` (so the database pools stay within the total)."""
    return max(1, -(-total // processes))
