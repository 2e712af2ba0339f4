"""API latency with a realistic table: p50/p99 of list and get with 10,000 jobs in PostgreSQL.

Run by `make bench` (benchmarks/run_all.py) or alone:
    .venv/bin/python benchmarks/controller_api.py [--database-url URL] [--jobs 10000] [--requests 300]
Without --database-url it starts a throwaway PostgreSQL cluster (as the tests do). The jobs are
bulk-inserted straight into the tables (the benchmark measures reads, not submission); the API runs
under uvicorn on 127.0.0.1 and is called over HTTP with a keep-alive client, one request at a time.
Prints one JSON line per operation; the target is p99 < 50 ms. Each line also carries the CPU time the
server (and the client, same process) spent per request and the load average, since wall latency on a
shared machine mostly measures the wait for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import uvicorn
from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import make_url

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # for tests.controller.pg when run as a script

from deepfleet.controller.app import create_app  # noqa: E402
from deepfleet.controller.db.migrate import upgrade_head  # noqa: E402
from deepfleet.controller.db.models import Job, JobLabel, Project  # noqa: E402
from deepfleet.controller.settings import Settings  # noqa: E402

TARGET_P99_MS = 50.0
ADMIN = "dft_0123456789ab_" + "b" * 32
PHASES = ["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"]


def _fresh_database(admin_url: str) -> str:
    name = f"bench_{uuid.uuid4().hex[:8]}"
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def _seed(url: str, n_jobs: int) -> list[str]:
    """Bulk-insert `n_jobs` jobs over 10 projects (1,000+ in the measured one), with labels."""
    spec = {"apiVersion": "deepfleet/v1", "kind": "TrainingJob",
            "metadata": {"name": "bench", "project": "research", "labels": {"team": "nlp"}},
            "spec": {"backend": "local", "nodes": 2, "entrypoint": {"script": "train.py", "args": []}}}
    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    rng = random.Random(0)
    projects = ["research"] + [f"team-{i}" for i in range(9)]
    jobs, labels, ids = [], [], []
    for i in range(n_jobs):
        job_id = uuid.UUID(int=rng.getrandbits(128)).hex
        project = "research" if i % 2 == 0 else projects[1 + i % 9]
        when = start + timedelta(seconds=i)
        jobs.append(dict(id=job_id, name=f"job-{i}", project=project, queue="default", backend="local",
                         priority="normal", spec=spec, spec_version="deepfleet/v1", world_size=2, gpus=0,
                         phase=PHASES[i % len(PHASES)], message="", desired_state="run", current_attempt=0,
                         restart_counts={}, created_at=when, updated_at=when))
        labels.append(dict(job_id=job_id, key="team", value=["nlp", "vision", "speech"][i % 3]))
        if project == "research":
            ids.append(job_id)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(insert(Project), [{"name": p, "created_at": start} for p in projects])
        conn.execute(insert(Job), jobs)
        conn.execute(insert(JobLabel), labels)
    # As autovacuum leaves a table in steady state: statistics, and the visibility map that lets the
    # listing's count read the (project, created_at) index alone instead of every row. VACUUM marks a
    # page all-visible only once its rows' commits are flushed to the WAL (it needs their hint bits),
    # which a server with synchronous_commit=off (the test clusters) has not done yet right after the
    # insert: a synchronous commit first (this ANALYZE's) flushes the WAL up to it.
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("SET synchronous_commit = on"))
        conn.execute(text("ANALYZE"))
        conn.execute(text("VACUUM ANALYZE"))
        visible = conn.execute(text("SELECT relallvisible = relpages FROM pg_class WHERE relname = 'jobs'")).scalar()
    if not visible:
        print("warning: VACUUM left pages of jobs not all-visible (another transaction open on this server?); "
              "listing counts read the table", file=sys.stderr)
    engine.dispose()
    return ids


@contextmanager
def _serve(settings: Settings) -> Iterator[str]:
    sock = socket.socket()  # bound here on port 0 and handed to uvicorn: no port picked and bound later
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start within 30 s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _measure(call: Callable[[], httpx.Response], *, n: int, warmup: int = 20) -> tuple[list[float], float]:
    """Wall latencies (ms) of `n` calls, and the CPU time (ms) this process (server + client) spent per call."""
    for _ in range(warmup):
        call().raise_for_status()
    times = []
    cpu0 = time.process_time()
    for _ in range(n):
        t0 = time.perf_counter()
        call().raise_for_status()
        times.append((time.perf_counter() - t0) * 1000)
    return times, (time.process_time() - cpu0) * 1000 / n


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", help="Admin URL of a PostgreSQL server (a database is created in it).")
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=300)
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
        settings = Settings(data_dir=Path(tmp), database_url=url, migrate_on_start=False, admin_token=ADMIN,
                            admin_project="research")
        with _serve(settings) as base, httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"},
                                                    timeout=30) as client:
            rng = random.Random(1)
            cursor = client.get("/v1/jobs", params={"limit": 50}).json()["next_cursor"]
            operations = {
                "list": lambda: client.get("/v1/jobs", params={"limit": 50}),
                "list_phase_filter": lambda: client.get("/v1/jobs", params={"limit": 50, "phase": "RUNNING"}),
                "list_label_filter": lambda: client.get("/v1/jobs", params={"limit": 50, "label": "team=vision"}),
                "list_next_page": lambda: client.get("/v1/jobs", params={"limit": 50, "cursor": cursor}),
                "get": lambda: client.get(f"/v1/jobs/{rng.choice(ids)}"),
            }
            for op, call in operations.items():
                times, cpu_ms = _measure(call, n=args.requests)
                p99 = _pct(times, 0.99)
                print(json.dumps({
                    "bench": "controller_api", "op": op, "jobs": args.jobs, "requests": args.requests,
                    "p50_ms": round(statistics.median(times), 2), "p99_ms": round(p99, 2),
                    "max_ms": round(max(times), 2), "cpu_ms_per_request": round(cpu_ms, 2),
                    "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(), "target_p99_ms": TARGET_P99_MS, "ok": p99 < TARGET_P99_MS,
                }), flush=True)


if __name__ == "__main__":
    main()
