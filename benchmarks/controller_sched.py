"""Controller scheduling benchmark: time to admit 1,000 queued jobs, and submit-to-RUNNING latency on the
local backend. Prints one JSON line per measurement. Run by `make bench` (benchmarks/run_all.py) or alone:

    .venv/bin/python benchmarks/controller_sched.py [--jobs 1000] [--latency-runs 5] [--db URL]

- `admit_pure`: `scheduler.admit` alone over N queued jobs (mixed priorities, queues and sizes).
- `admit_pass`: one reconciler admission pass over N PENDING rows in the database (SQLite by default,
  `--db`/`DATABASE_URL` for PostgreSQL): a lock-free read of N rows, decide, then at most `admit_budget`
  phase changes and events in transactions of `admit_batch` locked rows (`admitted` is that budget).
- `admit_decide`: the decision half of a pass alone (no decision applied: `admit_budget=0`), median of 5,
  reading the first `admit_window` jobs in rank order (the default) against reading the whole queue
  (`admit_window` = N, as passes did before the window), over the same N PENDING rows.
- `cancel_during_passes`: cancels of random PENDING jobs (the API's path: read the row, set the desired
  state, commit) timed while admission passes run back to back over the same N rows in another thread;
  a cancel waits only when its row is in the batch being changed at that moment.
- `submit_to_running`: a job row inserted -> the reconciler (polling every 20 ms) submits it to the local
  backend -> the backend reports RUNNING -> the phase is committed. The worker command is a sleeping
  process so the figure is the controller's and the backend's latency, not the training start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

from deepfleet.controller.backends.local import LocalBackend
from deepfleet.controller.db.models import Base, Job, Project, Queue
from deepfleet.controller.db.session import make_engine, make_session_factory
from deepfleet.controller.reconciler import Reconciler, ReconcilerConfig
from deepfleet.controller.scheduler import Demand, Limit, Priority, QueuedJob, admit


def document(name: str, nodes: int, *, priority: str = "normal", queue: str = "default") -> dict:
    return {"apiVersion": "deepfleet/v1", "kind": "TrainingJob", "metadata": {"name": name, "project": "bench"},
            "spec": {"backend": "local", "nodes": nodes, "entrypoint": {"script": "train.py"},
                     "priority": priority, "queue": queue, "restartPolicy": {"maxRestarts": 0, "backoffSeconds": 0}}}


def bench_pure(n: int) -> dict:
    rng = random.Random(0)
    t0 = datetime.now(timezone.utc)
    queued = [QueuedJob(f"j{i}", rng.choice(["a", "b", "c"]), rng.choice(list(Priority)),
                        Demand(rng.choice([1, 2, 4, 8]), rng.choice([0, 0, 8])), t0 + timedelta(seconds=i))
              for i in range(n)]
    start = time.perf_counter()
    out = admit(queued, used={}, capacity=Limit(processes=4 * n), quotas={"c": Limit(processes=n)}, now=t0)
    seconds = time.perf_counter() - start
    return {"bench": "controller_sched", "case": "admit_pure", "jobs": n, "admitted": len(out.admitted),
            "seconds": round(seconds, 4)}


def _sessions(url: str):
    engine = make_engine(url)
    Base.metadata.drop_all(engine)
    Base.metadata.create_all(engine)
    sessions = make_session_factory(engine)
    with sessions() as s, s.begin():
        s.add(Project(name="bench"))
        s.add(Queue(name="default"))
    return sessions


def bench_pass(n: int, url: str, tmp: Path) -> dict:
    sessions = _sessions(url)
    now = datetime.now(timezone.utc)
    with sessions() as s, s.begin():
        for i in range(n):
            nodes = 1 + i % 4
            s.add(Job(id=uuid.uuid4().hex, name=f"j{i}", project="bench", queue="default", backend="local",
                      priority=["low", "normal", "high"][i % 3], spec=document(f"j{i}", nodes),
                      spec_version="deepfleet/v1", world_size=nodes, gpus=0, phase="PENDING",
                      created_at=now + timedelta(milliseconds=i)))
    backend = LocalBackend(tmp / "logs-pass", slots=4 * n)
    rec = Reconciler(sessions, backend=backend, config=ReconcilerConfig(replica_id="bench", controller_url="http://127.0.0.1:9",
                                                         secret="s", capacity=Limit(processes=4 * n)))
    start = time.perf_counter()
    rec._hold_lease("scheduler-local", now)
    rec._admit(now)
    seconds = time.perf_counter() - start
    with sessions() as s:
        admitted = s.query(Job).filter(Job.phase == "ADMITTED").count()
    return {"bench": "controller_sched", "case": "admit_pass", "db": url.split(":")[0], "jobs": n,
            "admitted": admitted, "seconds": round(seconds, 4)}


def bench_decide(n: int, url: str, tmp: Path) -> dict:
    from dataclasses import replace

    sessions = _sessions(url)
    now = datetime.now(timezone.utc)
    with sessions() as s, s.begin():
        s.execute(Job.__table__.insert(), [
            dict(id=uuid.uuid4().hex, name=f"d{i}", project="bench", queue="default", backend="local",
                 priority=["low", "normal", "high"][i % 3], spec=document(f"d{i}", 1 + i % 4),
                 spec_version="deepfleet/v1", world_size=1 + i % 4, gpus=0, phase="PENDING",
                 created_at=now + timedelta(milliseconds=i)) for i in range(n)])
    config = ReconcilerConfig(replica_id="bench", controller_url="http://127.0.0.1:9", secret="s",
                              capacity=Limit(processes=4 * n), admit_budget=0)
    rec = Reconciler(sessions, backend=LocalBackend(tmp / "logs-decide", slots=4), config=config)
    rec._hold_lease("scheduler-local", now)
    out = {"bench": "controller_sched", "case": "admit_decide", "db": url.split(":")[0], "jobs": n,
           "window": config.admit_window}
    for label, window in (("whole_queue_s", n), ("window_s", config.admit_window)) * 2:  # interleaved
        rec.config = replace(config, admit_window=window)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            rec._admit(now)
            times.append(time.perf_counter() - start)
        out[label] = round(statistics.median(times), 4)  # the second round's figure is kept (warm)
    out["ratio"] = round(out["whole_queue_s"] / out["window_s"], 2)
    return out


def _admit_loop(url: str, n: int, logs: str, stop, passes) -> None:  # noqa: ANN001 - multiprocessing objects
    """Admission passes back to back until `stop` is set (in its own process: no GIL shared with cancels)."""
    sessions = make_session_factory(make_engine(url))
    # A small capacity: each pass re-decides the whole queue and admits a few (the queue stays long).
    rec = Reconciler(sessions, backend=LocalBackend(Path(logs), slots=4), config=ReconcilerConfig(
        replica_id="bench", controller_url="http://127.0.0.1:9", secret="s", capacity=Limit(processes=n // 2)))
    rec._hold_lease("scheduler-local", datetime.now(timezone.utc))
    while not stop.is_set():
        start = time.perf_counter()
        rec._admit(datetime.now(timezone.utc))
        passes.put(time.perf_counter() - start)


def bench_cancel(n: int, url: str, tmp: Path, *, cancels: int = 200) -> dict:
    import multiprocessing as mp

    sessions = _sessions(url)
    now = datetime.now(timezone.utc)
    ids = [uuid.uuid4().hex for _ in range(n)]
    with sessions() as s, s.begin():
        for i, job_id in enumerate(ids):
            s.add(Job(id=job_id, name=f"c{i}", project="bench", queue="default", backend="local",
                      priority=["low", "normal", "high"][i % 3], spec=document(f"c{i}", 1),
                      spec_version="deepfleet/v1", world_size=1, gpus=0, phase="PENDING",
                      created_at=now + timedelta(milliseconds=i)))
    ctx = mp.get_context("spawn")
    stop, passes = ctx.Event(), ctx.Queue()
    admitter = ctx.Process(target=_admit_loop, args=(url, n, str(tmp / "logs-cancel"), stop, passes))
    admitter.start()
    first = passes.get(timeout=300)  # cancels start once passes are running
    rng, waits = random.Random(1), []
    try:
        for job_id in rng.sample(ids, cancels):
            start = time.perf_counter()
            with sessions() as s:
                s.get(Job, job_id).desired_state = "cancel_requested"
                s.commit()
            waits.append(time.perf_counter() - start)
            time.sleep(0.01)
    finally:
        stop.set()
        admitter.join(timeout=300)
    times = [first]
    while not passes.empty():
        times.append(passes.get())
    waits.sort()
    return {"bench": "controller_sched", "case": "cancel_during_passes", "db": url.split(":")[0], "jobs": n,
            "cancels": cancels, "passes": len(times), "pass_median_s": round(statistics.median(times), 4),
            "cancel_p50_s": round(waits[len(waits) // 2], 4), "cancel_p99_s": round(waits[int(len(waits) * 0.99)], 4),
            "cancel_max_s": round(waits[-1], 4)}


def bench_latency(runs: int, url: str, tmp: Path) -> dict:
    sessions = _sessions(url)
    backend = LocalBackend(tmp / "logs-latency", slots=8, workdir=tmp, cancel_grace_s=1,
                           worker_command=[sys.executable, "-c", "import time; time.sleep(60)"])
    rec = Reconciler(sessions, backend=backend, config=ReconcilerConfig(replica_id="bench", controller_url="http://127.0.0.1:9",
                                                         secret="s", capacity=Limit(processes=8)))
    latencies = []
    for i in range(runs):
        job_id = uuid.uuid4().hex
        with sessions() as s, s.begin():
            s.add(Job(id=job_id, name=f"lat{i}", project="bench", queue="default", backend="local",
                      priority="normal", spec=document(f"lat{i}", 2), spec_version="deepfleet/v1", world_size=2,
                      gpus=0, phase="PENDING"))
        start = time.perf_counter()
        while True:
            rec.reconcile_once(datetime.now(timezone.utc))
            with sessions() as s:
                if s.get(Job, job_id).phase == "RUNNING":
                    break
            time.sleep(0.02)
        latencies.append(time.perf_counter() - start)
        with sessions() as s, s.begin():
            s.get(Job, job_id).desired_state = "cancel_requested"
        rec.reconcile_once(datetime.now(timezone.utc))
    return {"bench": "controller_sched", "case": "submit_to_running", "db": url.split(":")[0], "runs": runs,
            "nodes": 2, "median_s": round(statistics.median(latencies), 4), "max_s": round(max(latencies), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--latency-runs", type=int, default=5)
    p.add_argument("--db", default=os.environ.get("DATABASE_URL"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        url = args.db or f"sqlite:///{tmp / 'bench.db'}"
        print(json.dumps(bench_pure(args.jobs)), flush=True)
        print(json.dumps(bench_pass(args.jobs, url, tmp)), flush=True)
        print(json.dumps(bench_decide(max(args.jobs, 20_000), url, tmp)), flush=True)
        print(json.dumps(bench_cancel(args.jobs, url, tmp)), flush=True)
        print(json.dumps(bench_latency(args.latency_runs, url, tmp)), flush=True)


if __name__ == "__main__":
    main()
