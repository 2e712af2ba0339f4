"""Submits under concurrency on PostgreSQL: errors and latency of concurrent and bursty submits, list/get
latency at 10,000 jobs with concurrent readers while submits run, and /healthz latency throughout.

Run alone (the full figures want a quiet machine):
    .venv/bin/python benchmarks/controller_load.py [--database-url URL] [--concurrent 200] [--total 1000]
        [--burst 100] [--jobs 10000] [--readers 8] [--reads 200]
Without --database-url it starts a throwaway PostgreSQL cluster (as the tests do). The controller API
(`create_app`, no reconciler: this measures the API) runs under uvicorn in its own process; the load
comes from one asyncio client process. Targets: 200 concurrent submits with 0 errors and p99 < 1 s;
1,000 in bursts of 100 with no 5xx (a 429 with Retry-After is back-pressure, counted apart); list/get
p99 < 50 ms at 10,000 jobs with 8 readers while submits run; /healthz p99 < 100 ms in every phase.
Prints one JSON line per phase; the first measures, one request at a time, the CPU each kind of request
costs the server and (when this benchmark started it) the database server, and the read phase also says
where its CPU went (server, database, load client) against its wall time. The load comes from `benchmarks/raw_http.py` by default (`--client raw`),
whose requests cost a fraction of httpx's client CPU on the machine the server shares;
`--client httpx` measures with httpx instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.controller.pg and benchmarks.controller_api when run as a script

from benchmarks.controller_api import ADMIN, _fresh_database, _pct, _seed  # noqa: E402
from benchmarks.raw_http import RawClient  # noqa: E402
from benchmarks.raw_http import TransportError as RawTransportError  # noqa: E402
from deepfleet.controller.db.migrate import upgrade_head  # noqa: E402

SERVER = """
import sys
from deepfleet.controller.app import create_app
from deepfleet.controller.api.load import ApiProcesses, serve, with_api_processes
from deepfleet.controller.settings import Settings
data_dir, url, admin, fd, processes, inflight = sys.argv[1:7]
child = len(sys.argv) > 7
settings = Settings(data_dir=data_dir, database_url=url, migrate_on_start=False, admin_token=None if child else admin,
                    admin_project="research", api_processes=int(processes), max_inflight_requests=int(inflight))
app = create_app(settings)
if settings.api_processes > 1 and not child:
    with_api_processes(app, ApiProcesses([sys.executable, *sys.argv, "child"],
                                         count=settings.api_processes - 1, fd=int(fd)))
serve(app, fd=int(fd), log_level="warning", access_log=False)
"""
JOB = """apiVersion: deepfleet/v1
kind: TrainingJob
metadata: {{name: load-{i}, project: research, labels: {{team: nlp}}}}
spec:
  backend: local
  nodes: 2
  entrypoint: {{script: train.py, args: ["--steps", "50"]}}
  engine: {{train_micro_batch_size_per_gpu: 4, zero_optimization: {{stage: 2}}, optimizer: {{type: AdamW, params: {{lr: 0.001}}}}}}
"""
HEADERS = {"Authorization": f"Bearer {ADMIN}"}


def client(base: str, kind: str, *, connections: int, headers: dict[str, str] | None = None):
    """An async client of the API at `base`: the lean raw one or httpx, with the same calls."""
    if kind == "raw":
        host, port = base.removeprefix("http://").rsplit(":", 1)
        return RawClient(host, int(port), headers=headers, connections=connections)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=base, headers=headers, timeout=120, limits=limits)


class Health:
    """Samples /healthz every 20 ms on its own connection while a phase runs."""

    def __init__(self, base: str, kind: str) -> None:
        self.base, self.kind, self.times, self._stop = base, kind, [], asyncio.Event()

    async def run(self) -> None:
        async with client(self.base, self.kind, connections=1) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                (await c.get("/healthz")).raise_for_status()
                self.times.append((time.perf_counter() - t0) * 1000)
                await asyncio.sleep(0.02)

    def stop(self) -> dict:
        self._stop.set()
        return {"healthz_p99_ms": round(_pct(self.times, 0.99), 1) if self.times else None,
                "healthz_samples": len(self.times)}


async def _submit(c: httpx.AsyncClient, i: int) -> tuple[int, float]:
    t0 = time.perf_counter()
    try:
        r = await c.post("/v1/jobs", content=JOB.format(i=i), headers={"Content-Type": "application/yaml"})
    except (httpx.TransportError, RawTransportError):  # a reset or a timeout: counted as an error (status 0), never hidden
        return 0, (time.perf_counter() - t0) * 1000
    return r.status_code, (time.perf_counter() - t0) * 1000


def _summary(results: list[tuple[int, float]], wall_s: float) -> dict:
    codes = Counter(code for code, _ in results)
    times = [t for code, t in results if code == 201]
    return {"submits": len(results), "status": dict(codes), "errors": sum(n for c, n in codes.items() if c != 201),
            "server_errors": sum(n for c, n in codes.items() if c >= 500),
            "p50_ms": round(_pct(times, 0.5), 1) if times else None,
            "p99_ms": round(_pct(times, 0.99), 1) if times else None,
            "submits_per_s": round(codes.get(201, 0) / wall_s, 1)}


async def _server_cpu(c: httpx.AsyncClient, server: psutil.Process, db: psutil.Process | None, ids: list[str],
                      counter: Iterator[int], n: int = 200) -> None:
    """One request at a time: the server's CPU (all its threads and processes), the database server's (when
    it runs here) and the latency per request."""
    requests = {"submit": lambda k: _submit(c, next(counter)),
                "list": lambda k: c.get("/v1/jobs", params={"limit": 50}),
                "get": lambda k: c.get(f"/v1/jobs/{ids[k % len(ids)]}")}
    out = {}
    for op, send in requests.items():
        for k in range(10):  # warm: caches, prepared statements (psycopg prepares a statement on its 5th run)
            await send(k)
        cpu0, db0, t0, mine = _cpu_s(server), _cpu_s(db), time.perf_counter(), time.process_time()
        for k in range(1, n + 1):
            await send(k)
        out[op] = {"server_cpu_ms": round((_cpu_s(server) - cpu0) * 1000 / n, 2),
                   "db_cpu_ms": round((_cpu_s(db) - db0) * 1000 / n, 2) if db is not None else None,
                   "client_cpu_ms": round((time.process_time() - mine) * 1000 / n, 2),
                   "latency_ms": round((time.perf_counter() - t0) * 1000 / n, 2)}
    print(json.dumps({"bench": "controller_load", "phase": "one_at_a_time", "requests_each": n, **out}), flush=True)


def _settle(server: psutil.Process, timeout_s: float = 60.0) -> None:
    """Wait until the server's processes are idle (the extra API processes start after the first answers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = _cpu_s(server)
        time.sleep(0.5)
        if _cpu_s(server) - before < 0.05:
            return


def _cpu_s(server: psutil.Process | None) -> float:
    """CPU seconds of `server` and its children so far (processes that ended since are not counted)."""
    if server is None:
        return 0.0
    total = 0.0
    for p in [server, *server.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:  # a database backend that just ended
            continue
        total += t.user + t.system
    return total


def _local_postgres(url: str) -> psutil.Process | None:
    """The postmaster of the throwaway cluster at `url` (a socket folder holding its data dir), else None."""
    host = parse_qs(urlsplit(url).query).get("host", [""])[0]
    pid_file = Path(host) / "data" / "postmaster.pid" if host else None
    if pid_file is None or not pid_file.exists():
        return None
    return psutil.Process(int(pid_file.read_text().split()[0]))


async def _phases(base: str, args: argparse.Namespace, ids: list[str], server: psutil.Process,
                  db: psutil.Process | None) -> None:
    async with client(base, args.client, connections=args.concurrent + 16, headers=HEADERS) as c:
        counter = iter(range(10**9))
        await _server_cpu(c, server, db, ids, counter)

        health = Health(base, args.client)
        sampler = asyncio.create_task(health.run())
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_submit(c, next(counter)) for _ in range(args.concurrent)))
        summary = _summary(results, time.perf_counter() - t0)
        print(json.dumps({"bench": "controller_load", "phase": "concurrent_submits", **summary, **health.stop(),
                          "target": "0 errors, p99 < 1000 ms", "ok": summary["errors"] == 0
                          and (summary["p99_ms"] or 1e9) < 1000}), flush=True)
        await sampler

        health = Health(base, args.client)
        sampler = asyncio.create_task(health.run())
        results, t0 = [], time.perf_counter()
        for _ in range(args.total // args.burst):
            results += await asyncio.gather(*(_submit(c, next(counter)) for _ in range(args.burst)))
        summary = _summary(results, time.perf_counter() - t0)
        print(json.dumps({"bench": "controller_load", "phase": "burst_submits", "burst": args.burst, **summary,
                          **health.stop(), "target": "no 5xx", "ok": summary["server_errors"] == 0}), flush=True)
        await sampler

        health = Health(base, args.client)
        sampler = asyncio.create_task(health.run())
        stop = asyncio.Event()

        async def submitter() -> list[tuple[int, float]]:
            out = []
            while not stop.is_set():
                out.append(await _submit(c, next(counter)))
            return out

        async def reader(k: int) -> dict[str, list[float]]:
            times: dict[str, list[float]] = {"list": [], "get": []}
            for n in range(args.reads):
                op = "list" if n % 2 == 0 else "get"
                t0 = time.perf_counter()
                r = await (c.get("/v1/jobs", params={"limit": 50}) if op == "list"
                           else c.get(f"/v1/jobs/{ids[(k * 7919 + n) % len(ids)]}"))
                r.raise_for_status()
                times[op].append((time.perf_counter() - t0) * 1000)
            return times

        cpu0, db0, t0, mine = _cpu_s(server), _cpu_s(db), time.perf_counter(), time.process_time()
        submitting = [asyncio.create_task(submitter()) for _ in range(2)]
        read = await asyncio.gather(*(reader(k) for k in range(args.readers)))
        stop.set()
        submitted = [x for task in submitting for x in await task]
        # Where the read phase's CPU went: how busy the cores were with this benchmark's own work.
        cpu = {"wall_s": round(time.perf_counter() - t0, 2), "server_cpu_s": round(_cpu_s(server) - cpu0, 2),
               "db_cpu_s": round(_cpu_s(db) - db0, 2) if db is not None else None,
               "client_cpu_s": round(time.process_time() - mine, 2)}
        for op in ("list", "get"):
            times = [t for r in read for t in r[op]]
            p99 = _pct(times, 0.99)
            print(json.dumps({"bench": "controller_load", "phase": f"{op}_under_submits", "jobs": args.jobs,
                              "readers": args.readers, "requests": len(times),
                              "p50_ms": round(_pct(times, 0.5), 1), "p99_ms": round(p99, 1),
                              "concurrent_submits_done": len(submitted),
                              "submit_server_errors": sum(1 for code, _ in submitted if code >= 500),
                              **({} if op == "list" else {**health.stop(), "read_phase": cpu}),
                              "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
                              "target": "p99 < 50 ms", "ok": p99 < 50}), flush=True)
        await sampler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", help="Admin URL of a PostgreSQL server (a database is created in it).")
    parser.add_argument("--concurrent", type=int, default=200)
    parser.add_argument("--total", type=int, default=1000)
    parser.add_argument("--burst", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs in the table before the read phase")
    parser.add_argument("--readers", type=int, default=8)
    parser.add_argument("--reads", type=int, default=200, help="requests per reader")
    parser.add_argument("--max-inflight", type=int, default=12, help="the server's max_inflight_requests, shared by its processes")
    parser.add_argument("--client", choices=["raw", "httpx"], default="raw",
                        help="the load generator's HTTP client (raw: benchmarks/raw_http.py, lean on CPU)")
    parser.add_argument("--api-processes", type=int, default=3, help="server processes on the socket "
                        "(`deepfleet server --api-processes`)")
    args = parser.parse_args(argv)
    if args.database_url:
        cluster = nullcontext(args.database_url)
    else:
        from tests.controller.pg import postgres_cluster

        cluster = postgres_cluster()
    with cluster as admin_url, tempfile.TemporaryDirectory() as tmp:
        url = _fresh_database(admin_url)
        upgrade_head(url)
        ids = _seed(url, args.jobs)
        db = _local_postgres(admin_url)
        # The listening socket is bound here (port 0) and handed to the server process, so no other
        # process can take the port between choosing and binding it.
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
        script = Path(tmp) / "server.py"
        script.write_text(SERVER)
        server = subprocess.Popen([sys.executable, str(script), tmp, url, ADMIN, str(sock.fileno()),
                                   str(args.api_processes), str(args.max_inflight)],
                                  env={**os.environ, "OMP_NUM_THREADS": "1"}, pass_fds=(sock.fileno(),))
        sock.close()  # the server holds its own copy
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(base + "/v1/jobs", headers=HEADERS, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the controller did not start")
                time.sleep(0.2)
            _settle(psutil.Process(server.pid))
            asyncio.run(_phases(base, args, ids, psutil.Process(server.pid), db))
        finally:
            server.terminate()
            server.wait(timeout=30)


if __name__ == "__main__":
    main()
