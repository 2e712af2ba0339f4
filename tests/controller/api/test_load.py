"""Under load and outages: the request gate answers 429 with Retry-After past its limit and never holds
back /healthz, lets waiting reads in before waiting writes and closes the connections a saturated process
answers; an unreachable database gives 503 JSON with Retry-After, logged once per outage; inputs
PostgreSQL cannot store (NUL bytes, numbers past a column's range) are 422, never 500."""

from __future__ import annotations

import asyncio
import json
import logging
import os

import httpx
import pytest
from sqlalchemy.exc import OperationalError

from deepfleet.controller.api.load import RequestGate
from deepfleet.controller.app import create_app
from deepfleet.controller.db.outage import Outage
from deepfleet.controller.settings import Settings
from tests.controller.api.helpers import job_yaml, token, yaml_headers
from tests.controller.conftest import ADMIN_TOKEN, TestClient

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def test_the_gate_sheds_load_with_429_and_lets_health_through() -> None:
    release = asyncio.Event()
    entered = []

    async def slow_app(scope, receive, send) -> None:
        entered.append(scope["path"])
        if scope["path"] == "/v1/jobs":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    gate = RequestGate(slow_app, limit=1, queue_timeout_s=0.05)

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=gate)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            first = asyncio.create_task(c.get("/v1/jobs"))
            while not entered:
                await asyncio.sleep(0)
            busy = await c.get("/v1/jobs")  # the one slot is taken: waits 0.05 s, then 429
            health = await c.get("/healthz")  # never gated
            nul = await c.get("/v1/jobs?name=a%00b")
            release.set()
            return [await first, busy, health, nul]

    first, busy, health, nul = asyncio.run(scenario())
    assert first.status_code == 200 and health.status_code == 200
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert busy.json()["errors"] == ["(request): the controller is at its request limit; retry after 1 s"]
    assert nul.status_code == 422 and "NUL" in nul.json()["errors"][0]


def _gated(limit: int, *, shed: bool = True) -> tuple[RequestGate, list[str], dict[str, asyncio.Event]]:
    """A gate in front of an app whose requests each wait for their own event (by path) to finish."""
    entered: list[str] = []
    finish: dict[str, asyncio.Event] = {}

    async def app(scope, receive, send) -> None:
        entered.append(scope["path"])
        await finish.setdefault(scope["path"], asyncio.Event()).wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    return RequestGate(app, limit=limit, queue_timeout_s=5, shed=shed), entered, finish


async def _until(condition) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the gate never got there")


def test_reads_take_a_freed_slot_before_waiting_writes_and_busy_answers_close_the_connection() -> None:
    gate, entered, finish = _gated(limit=1)

    async def scenario() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://t") as c:
            first = asyncio.create_task(c.post("/first"))
            await _until(lambda: entered == ["/first"])
            write = asyncio.create_task(c.post("/write"))
            await _until(lambda: len(gate._writes) == 1)
            read = asyncio.create_task(c.get("/read"))
            await _until(lambda: len(gate._reads) == 1)
            finish["/first"].set()
            await _until(lambda: entered[-1] == "/read")
            finish["/read"].set()
            await _until(lambda: entered[-1] == "/write")
            finish["/write"].set()
            return {"first": await first, "read": await read, "write": await write}

    answers = asyncio.run(scenario())
    assert entered == ["/first", "/read", "/write"]  # the read queued after the write, and went first
    assert all(r.status_code == 200 for r in answers.values())
    # /first and /read answered while others waited: their clients reconnect (to a less busy process);
    # the last one answered with nobody waiting keeps its connection.
    assert [answers[k].headers.get("connection") for k in ("first", "read", "write")] == ["close", "close", None]
    assert gate._free == 1


def test_waiting_writes_get_every_other_slot_past_the_limit_and_one_process_never_sheds() -> None:
    gate, entered, finish = _gated(limit=1, shed=False)

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://t") as c:
            tasks = [asyncio.create_task(c.get("/r0"))]
            await _until(lambda: entered == ["/r0"])
            tasks.append(asyncio.create_task(c.post("/w1")))
            await _until(lambda: len(gate._writes) == 1)
            for i in range(1, 4):
                tasks.append(asyncio.create_task(c.get(f"/r{i}")))
                await _until(lambda i=i: len(gate._reads) == i)
            for _ in range(5):
                n = len(entered)
                finish[entered[-1]].set()
                if n < 5:
                    await _until(lambda n=n: len(entered) == n + 1)
            return await asyncio.gather(*tasks)

    answers = asyncio.run(scenario())
    # limit 1: one read goes ahead of the waiting write, then the write, then the other reads.
    assert entered == ["/r0", "/r1", "/w1", "/r2", "/r3"]
    assert all(r.status_code == 200 and "connection" not in r.headers for r in answers)


def test_a_waiter_that_leaves_or_times_out_gives_no_slot_away() -> None:
    gate, entered, finish = _gated(limit=1)
    gate.queue_timeout_s = 0.05

    async def scenario() -> tuple[int, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gate), base_url="http://t") as c:
            first = asyncio.create_task(c.get("/first"))
            await _until(lambda: entered == ["/first"])
            leaving = asyncio.create_task(c.get("/leaving"))
            await _until(lambda: len(gate._reads) == 1)
            leaving.cancel()  # the client went away while it waited
            late = await c.post("/late")  # waits 0.05 s behind /first: 429
            finish["/first"].set()
            await first
            finish["/after"] = asyncio.Event()
            finish["/after"].set()
            after = await c.get("/after")
            return late.status_code, after.status_code

    assert asyncio.run(scenario()) == (429, 200)
    assert entered == ["/first", "/after"] and gate._free == 1 and not gate._reads and not gate._writes


def test_a_served_app_freezes_its_start_up_objects_once_started(app) -> None:
    """`serve` wraps the app so that what start-up made is out of the collector's reach (short full
    collections)."""
    import gc

    from deepfleet.controller.api.load import FreezeAfterStartup

    gc.unfreeze()
    try:
        with TestClient(FreezeAfterStartup(app)) as client:
            assert gc.get_freeze_count() > 10_000  # the modules, the app, the engine config's models
            assert client.get("/healthz").status_code == 200
    finally:
        gc.unfreeze()


def test_an_unreachable_database_is_503_json_logged_once(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    # a socket folder where no server listens: unreachable without guessing at a free TCP port
    url = f"postgresql+psycopg://postgres@/none?host={tmp_path / 'no-server'}&connect_timeout=1"
    settings = Settings(data_dir=tmp_path, database_url=url, migrate_on_start=False, secret="s")
    app = create_app(settings)
    caplog.set_level(logging.WARNING, logger="deepfleet.controller.api")
    with TestClient(app) as client:
        answers = [client.get("/v1/jobs", headers=ADMIN) for _ in range(4)]
        answers.append(client.post("/v1/jobs", content=job_yaml(), headers=yaml_headers(ADMIN)))
        assert client.get("/healthz").status_code == 200
    for r in answers:
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        assert r.json()["detail"] == "database unavailable"
    lines = [rec for rec in caplog.records if "database unavailable" in rec.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None


def test_a_client_that_leaves_mid_body_is_no_server_error(client, app) -> None:
    """A submit whose client disconnects before its whole body arrived ends quietly: no exception
    escapes the application (uvicorn would log it as a 500 with a traceback)."""
    messages = iter([{"type": "http.request", "body": b"apiVersion: deepfleet/v1\n", "more_body": True},
                     {"type": "http.disconnect"}])
    sent: list[dict] = []

    async def receive() -> dict:
        return next(messages)

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(k.lower().encode(), v.encode()) for k, v in yaml_headers(ADMIN).items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/jobs", "raw_path": b"/v1/jobs", "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 9), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [400]


def test_values_postgres_cannot_store_are_422(client, app) -> None:
    member = token(app, project="research", role="member")
    doc = {"apiVersion": "deepfleet/v1", "kind": "TrainingJob", "metadata": {"name": "n", "project": "research"},
           "spec": {"entrypoint": {"script": "t.py"}, "env": {"A": "x\u0000y"}}}
    r = client.post("/v1/jobs", content=json.dumps(doc), headers={**member, "Content-Type": "application/json"})
    assert r.status_code == 422 and r.json()["errors"] == ["(document): a value contains a NUL character; remove it"]
    for line in ("  nodes: 100000000000000000000000000000\n", "  processesPerNode: 3000000000\n",
                 "  restartPolicy: {backoffSeconds: .inf}\n", "  checkpoint: {dir: ck, everySteps: 99999999999999}\n",
                 "  resources: {gpu: 4294967297}\n"):
        body = job_yaml().replace("  nodes: 2\n", "") + line
        r = client.post("/v1/jobs", content=body, headers=yaml_headers(member))
        assert r.status_code == 422, (line, r.status_code, r.text)
    for query in ("name=a%00", "label=a%3Db%00", "cursor=%00", "queue=%00"):
        assert client.get(f"/v1/jobs?{query}", headers=member).status_code == 422, query
    labels = "&".join(f"label=k{i}%3Dv" for i in range(17))
    r = client.get(f"/v1/jobs?{labels}", headers=member)
    assert r.status_code == 422 and len(r.content) < 2048


def test_a_flapping_database_is_one_outage_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    # a fast shutdown ends sessions one by one, so some requests still succeed between the failures
    now = [0.0]
    outage = Outage(settle_s=1.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="deepfleet.controller.db")
    lost = OperationalError("SELECT 1", {}, Exception("terminating connection due to administrator command"))
    for t, ok in [(0.0, False), (0.1, True), (0.2, False), (0.5, True), (1.4, False), (3.0, False),
                  (5.0, True), (5.5, True)]:
        now[0] = t
        outage.recovered() if ok else outage.failed(lost)
        assert outage.since == 0.0, t  # one outage from the first failure on
    now[0] = 6.0
    outage.recovered()  # answering since 5.0, for the settle time: over
    assert outage.since is None
    messages = [rec.getMessage() for rec in caplog.records]
    assert sum("database unavailable" in m for m in messages) == 1
    assert [m for m in messages if "reachable again" in m] == ["database reachable again after 6.0 s"]


@pytest.mark.parametrize("opened", ["inherited_socket", "uvicorn_fromfd"])
def test_connections_on_an_inherited_listening_socket_get_tcp_nodelay(opened: str) -> None:
    """The accepted connection's TCP_NODELAY as asyncio's server sets it (uvicorn serves through
    `loop.create_server(sock=...)`): on with our opening of the handed-over socket, off with uvicorn's
    `fd=` path, which labels the socket AF_UNIX (then every response waits out a delayed ACK)."""
    import socket

    from deepfleet.controller.api.load import inherited_socket

    parent = socket.socket()
    parent.bind(("127.0.0.1", 0))
    parent.listen(8)
    fd = os.dup(parent.fileno())
    listener = inherited_socket(fd) if opened == "inherited_socket" else socket.fromfd(fd, socket.AF_UNIX,
                                                                                        socket.SOCK_STREAM)
    seen: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            conn = transport.get_extra_info("socket")
            seen.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def scenario() -> None:
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        _, writer = await asyncio.open_connection(*parent.getsockname())
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()

    try:
        asyncio.run(scenario())
    finally:
        parent.close()
        if opened != "inherited_socket":
            os.close(fd)
    assert seen == ([1] if opened == "inherited_socket" else [0])
