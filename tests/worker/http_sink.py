"""A real HTTP server on 127.0.0.1 standing in for the controller's heartbeat and failure endpoints:
it records (path, Authorization header, JSON body) of every POST and answers 204. `delay_s` makes each
request hang until `release` is set, to play a slow controller."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Sink(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, delay_s: float = 0.0) -> None:
        self.received: list[tuple[str, str | None, dict]] = []
        self.delay_s = delay_s
        self.release = threading.Event()
        self.arrived = threading.Event()
        super().__init__(("127.0.0.1", 0), _Handler)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def bodies(self, path: str) -> list[dict]:
        return [b for p, _, b in list(self.received) if p == path]


class _Handler(BaseHTTPRequestHandler):
    server: Sink

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.arrived.set()
        if self.server.delay_s:
            self.server.release.wait(self.server.delay_s)
        self.server.received.append((self.path, self.headers.get("Authorization"), body))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def running_sink(delay_s: float = 0.0) -> Iterator[Sink]:
    srv = Sink(delay_s)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.release.set()
        srv.shutdown()
        srv.server_close()
