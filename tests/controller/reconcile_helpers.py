"""Shared pieces of the reconciler tests: a database with the controller's tables, job rows as the API
records them, and a reconciler on the local backend running the fake worker."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from deepfleet.controller.backends.local import LocalBackend
from deepfleet.controller.db.models import Base, Event, Job, Project, Queue
from deepfleet.controller.db.session import make_engine, make_session_factory
from deepfleet.controller.reconciler import Reconciler, ReconcilerConfig
from deepfleet.controller.registry import ModelRegistry
from deepfleet.controller.scheduler import Limit
from deepfleet.controller.spec import JobSpec, job_world_size
from tests.controller.jobspecs import FAKE_WORKER, job_document


def database(url: str) -> sessionmaker[Session]:
    engine = make_engine(url)
    Base.metadata.create_all(engine)
    sessions = make_session_factory(engine)
    with sessions() as s, s.begin():
        if s.get(Project, "test") is None:
            s.add(Project(name="test"))
        for q in ("default", "small"):
            if s.get(Queue, q) is None:
                s.add(Queue(name=q, max_processes=2 if q == "small" else None))
    return sessions


def insert_job(sessions: sessionmaker[Session], doc: dict, *, created: datetime | None = None) -> str:
    spec = JobSpec.model_validate(doc)
    job_id = uuid.uuid4().hex
    with sessions() as s, s.begin():
        s.add(Job(id=job_id, name=spec.metadata.name, project=spec.metadata.project, queue=spec.spec.queue,
                  backend=spec.spec.backend, priority=spec.spec.priority, spec=spec.to_document(),
                  spec_version="deepfleet/v1", world_size=job_world_size(spec), gpus=0, phase="PENDING",
                  created_at=created or datetime.now(timezone.utc)))
    return job_id


def reconciler(sessions: sessionmaker[Session], tmp_path: Path, *, replica: str = "r1", slots: int = 8,
               lease_seconds: float = 30.0, registry: ModelRegistry | None = None) -> Reconciler:
    backend = LocalBackend(tmp_path / "logs", slots=slots, workdir=tmp_path, worker_command=FAKE_WORKER,
                           cancel_grace_s=2)
    config = ReconcilerConfig(replica_id=replica, controller_url="http://127.0.0.1:9", secret="s",
                              capacity=Limit(processes=slots), lease_seconds=lease_seconds)
    return Reconciler(sessions, backend=backend, config=config, registry=registry)


def job(sessions: sessionmaker[Session], job_id: str) -> Job:
    with sessions() as s:
        return s.get(Job, job_id)


def events(sessions: sessionmaker[Session], job_id: str) -> list[str]:
    with sessions() as s:
        return [e.type for e in s.scalars(select(Event).where(Event.job_id == job_id).order_by(Event.id))]


def drive(rec: Reconciler, sessions: sessionmaker[Session], job_id: str, phases: set[str], *,
          timeout: float = 30.0, now=None) -> Job:
    """Run passes (real time for the processes, injected `now` for the decisions) until the job is in `phases`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec.reconcile_once(now() if now else datetime.now(timezone.utc))
        current = job(sessions, job_id)
        if current.phase in phases:
            return current
        time.sleep(0.05)
    raise AssertionError(f"job never reached {phases}: {current.phase} {current.message} {events(sessions, job_id)}")


def starts(tmp_path: Path, run: str, node: int = 0) -> int:
    """How many times node `node` of backend run `run` was started (the worker logs one line per start)."""
    log = tmp_path / "logs" / run / f"node-{node}.log"
    return log.read_text().count(f"fake worker node {node} attempt") if log.exists() else 0


def run_replicas_until_succeeded(replicas: list[Reconciler], sessions: sessionmaker[Session], ids: list[str], *,
                                 interval_s: float, timeout_s: float = 60.0) -> None:
    """Run every replica's loop in its own thread until all `ids` SUCCEEDED (or the timeout), then stop them."""
    stop = threading.Event()
    threads = [threading.Thread(target=r.run, args=(stop,), kwargs={"interval_s": interval_s}) for r in replicas]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(job(sessions, j).phase != "SUCCEEDED" for j in ids):
            time.sleep(0.1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)


__all__ = ["database", "drive", "events", "insert_job", "job", "job_document", "reconciler",
           "run_replicas_until_succeeded", "starts"]
