"""Recording intent in the database: submit a job, request a cancel, store heartbeats, write events.

Called by the API routers (one call per request, inside the request's session) and usable by the
reconciler for its own events (`record_event`) and its claims (`claim_jobs`). Every state change writes an `Event` with who and
when, in the same transaction as the change. Nothing here calls a backend (nor imports one: the
API's import contract covers indirect imports too).
"""

from __future__ import annotations

import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, func, insert, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from deepfleet.controller import provenance as prov
from deepfleet.controller.db import provenance as chain
from deepfleet.controller.db.models import (
    JOB_PHASES,
    TERMINAL_PHASES,
    Event,
    Heartbeat,
    Job,
    JobLabel,
    Project,
    Queue,
    utcnow,
)
from deepfleet.controller.goodput import AttemptTimes, Beat, Goodput, eta_s, goodput
from deepfleet.controller.sources import checkpoint_source, reach_errors
from deepfleet.controller.spec import KIND, AnyJob, is_serving, job_world_size, node_bounds
from deepfleet.worker.spec import FailureReport
from deepfleet.worker.spec import Heartbeat as HeartbeatReport


class Conflict(ValueError):
    """The request is valid but the job's state refuses it (e.g. cancelling a finished job)."""


class UnknownReference(ValueError):
    """The spec names something that does not exist here; `.errors` are field-path lines."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


def record_event(
    session: Session, job_id: str, *, actor: str, type: str, message: str = "",
    attempt: int | None = None, data: dict[str, Any] | None = None, time: datetime | None = None,
) -> Event:
    """Append one audit event (committed with the caller's transaction)."""
    event = Event(job_id=job_id, actor=actor, type=type, message=message, attempt=attempt, data=data,
                  time=time or utcnow())
    session.add(event)
    return event


def claim_free(replica_id: str, now: datetime) -> ColumnElement[bool]:
    """A job no replica holds, or this one, or whose claim has expired."""
    return or_(Job.claimed_by.is_(None), Job.claimed_by == replica_id, Job.claim_expires_at < now)


def claim_jobs(sessions: sessionmaker[Session], *, where: Sequence[ColumnElement[bool]],
               recheck: Sequence[ColumnElement[bool]], order_by: Sequence[Any], limit: int, replica_id: str,
               until: datetime, skip_locked: bool = False) -> list[str]:
    """Claim up to `limit` jobs matching `where` (first by `order_by`) for `replica_id` until `until`; returns
    their ids. Each claim is a compare-and-set on `recheck`, so a job another replica claimed since the select
    is passed over. `skip_locked`: on PostgreSQL the select skips rows other transactions hold (SELECT ... FOR
    UPDATE SKIP LOCKED). The claims of the reconciler and of model registration (`controller.registration`)."""
    with sessions() as s, s.begin():
        query = select(Job.id).where(*where).order_by(*order_by).limit(limit)
        if skip_locked and s.get_bind().dialect.name == "postgresql":
            query = query.with_for_update(skip_locked=True)
        claimed = []
        for job_id in list(s.scalars(query)):
            result = s.execute(update(Job).where(Job.id == job_id, *recheck)
                               .values(claimed_by=replica_id, claim_expires_at=until)
                               .execution_options(synchronize_session=False))
            if result.rowcount == 1:
                claimed.append(job_id)
    return claimed


class _Known:
    """Names of rows found to exist, per database engine, remembered for `ttl_s`: projects and queues are
    never deleted through the controller, so a submit need not look each one up again (two round trips).
    Keyed by the engine object itself (weakly), so a lookup costs no URL rendering and an engine that is
    gone takes its names with it."""

    def __init__(self, ttl_s: float = 30.0) -> None:
        self.ttl_s = ttl_s
        self._seen: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], float]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __contains__(self, item: tuple[Session, str, str]) -> bool:
        session, table, name = item
        seen = self._seen.get(session.get_bind(), {}).get((table, name))
        return seen is not None and time.monotonic() - seen < self.ttl_s

    def add(self, session: Session, table: str, name: str) -> None:
        with self._lock:
            names = self._seen.setdefault(session.get_bind(), {})
            if len(names) > 10_000:
                names.clear()
            names[(table, name)] = time.monotonic()


KNOWN = _Known()


def ensure_project(session: Session, name: str) -> None:
    """The project's row exists (created on first use)."""
    if (session, "projects", name) in KNOWN:
        return
    if session.get(Project, name) is None:  # remembered once found: this transaction may yet roll back
        session.add(Project(name=name))
        session.flush()
        return
    KNOWN.add(session, "projects", name)


def queue_exists(session: Session, name: str) -> bool:
    if (session, "queues", name) in KNOWN:
        return True
    if session.get(Queue, name) is None:
        return False
    KNOWN.add(session, "queues", name)
    return True


def create_job(session: Session, spec: AnyJob, *, actor: str, backends: list[str], default_namespace: str = "default",
               allowed_claims: list[str] | None = None) -> Job:
    """Store a validated spec as a PENDING job and its Submitted event. Raises UnknownReference.

    A job named by `checkpoint.resumeFrom` (a ServingJob's `model.job`) must be one of the same project
    whose checkpoints this job's backend can read (`controller.sources.reach_errors`: on kubernetes its
    claim in `default_namespace` unless the specs name one, and among the project's `allowed_claims`)."""
    s = spec.spec
    errors = []
    if s.backend not in backends:
        errors.append(f"spec.backend: this controller runs {', '.join(backends)} jobs, not {s.backend}; "
                      f"set spec.backend to one of them")
    if not queue_exists(session, s.queue):
        known = session.scalars(select(Queue.name).order_by(Queue.name)).all()
        errors.append(f"spec.queue: queue {s.queue!r} does not exist; use one of {', '.join(known)}")
    source = s.checkpoint.resume_from if s.checkpoint is not None else None
    if source is not None:
        found = session.get(Job, source)
        field = "spec.model.job" if is_serving(spec) else "spec.checkpoint.resumeFrom"
        if found is None or found.project != spec.metadata.project:
            errors.append(f"{field}: no job {source!r} in project {spec.metadata.project!r}; "
                          "name a job of this project")
        elif is_serving(spec) and (found.spec.get("kind") != KIND or found.phase not in TERMINAL_PHASES):
            errors.append(f"{field}: job {source!r} is a {found.spec.get('kind')} in phase {found.phase}; "
                          "name a finished TrainingJob (its newest complete checkpoint is served)")
        else:
            where = checkpoint_source(found.id, project=found.project, backend=found.backend, document=found.spec)
            errors += reach_errors(where, backend=s.backend, namespace=s.kubernetes.namespace if s.kubernetes else None,
                                   field=field, default_namespace=default_namespace,
                                   allowed_claims=allowed_claims or [])
    if errors:
        raise UnknownReference(errors)
    ensure_project(session, spec.metadata.project)
    now = utcnow()
    job = Job(
        id=uuid.uuid4().hex,
        name=spec.metadata.name,
        project=spec.metadata.project,
        queue=s.queue,
        backend=s.backend,
        priority=s.priority,
        spec=spec.to_document(),
        spec_version=spec.api_version,
        world_size=job_world_size(spec),
        gpus=node_bounds(spec)[1] * s.resources.gpu,
        phase="PENDING",
        message="waiting for admission",
        desired_state="run",
        current_attempt=0,
        restart_counts={},
        submitted_by=actor,
        created_at=now,
        updated_at=now,
        labels=[JobLabel(key=k, value=v) for k, v in spec.metadata.labels.items()],
        attempts=[],  # a new job has none: its detail answer needs no query for them
    )
    session.add(job)
    session.flush()  # the job's row first: the event and the provenance record refer to it
    # The event and the chain's first record as plain INSERTs: nothing reads them back here.
    session.execute(insert(Event), [dict(job_id=job.id, actor=actor, type="Submitted", time=now, attempt=None, data=None,
                                         message=f"{s.backend} job, {job.world_size} processes, queue {s.queue}")])
    engine = spec.validated_engine_config(job.world_size) or prov.normalized_engine_config(job.spec, job.world_size)
    chain.start_chain(session, job.id, "submit", {
        "spec": job.spec, "spec_sha256": prov.sha256_json(job.spec),
        "engine_config": engine, "engine_config_sha256": prov.sha256_json(engine) if engine is not None else None,
        "submitted_by": actor, "deepfleet_version": prov.deepfleet_version(),
        **({"resumed_from_job": source} if source is not None else {}),
    }, time=now)
    return job


def get_job(session: Session, job_id: str, *, project: str) -> Job | None:
    """The job if it belongs to `project` (another project's job is indistinguishable from none)."""
    return session.scalars(select(Job).where(Job.id == job_id, Job.project == project)).one_or_none()


def request_cancel(session: Session, job: Job, *, actor: str) -> bool:
    """Record the wish to cancel; the reconciler acts on it. False when it was already requested.

    Raises Conflict for a job that already finished.
    """
    if job.phase in TERMINAL_PHASES:
        raise Conflict(f"job {job.id} already finished ({job.phase}); nothing to cancel")
    if job.desired_state == "cancel_requested":
        return False
    job.desired_state = "cancel_requested"
    job.updated_at = utcnow()
    record_event(session, job.id, actor=actor, type="CancelRequested", attempt=job.current_attempt,
                 message="cancel requested; the controller stops every process of the job")
    return True


def record_heartbeat(session: Session, job: Job, report: HeartbeatReport, *, attempt: int | None = None) -> Heartbeat:
    """Store one heartbeat and refresh the job's last-heartbeat summary."""
    now = utcnow()
    row = Heartbeat(
        job_id=job.id, attempt=job.current_attempt if attempt is None else attempt, time=report.time,
        received_at=now, step=report.step, loss=report.loss, lr=report.lr, grad_norm=report.grad_norm,
        tokens_per_s=report.tokens_per_s, last_complete_checkpoint=report.last_complete_checkpoint,
        mfu=report.mfu, checkpoint_s=report.checkpoint_s, dp_epsilon=report.dp_epsilon, dp_delta=report.dp_delta,
    )
    session.add(row)
    previous = (job.last_heartbeat or {}).get("last_complete_checkpoint")
    job.last_heartbeat = report.model_dump(mode="json")
    job.last_heartbeat_at = now
    if report.last_complete_checkpoint and report.last_complete_checkpoint != previous:
        record_event(session, job.id, actor="worker:0", type="CheckpointSaved", attempt=row.attempt,
                     message=f"checkpoint {report.last_complete_checkpoint} complete at step {report.step}")
    _record_provenance(session, job, report, attempt=row.attempt)
    return row


def _record_provenance(session: Session, job: Job, report: HeartbeatReport, *, attempt: int) -> None:
    """Append what this heartbeat brings that the chain lacks: the attempt's torch version, newly
    reported datasets, and a newly completed checkpoint (with the attempt that wrote it)."""
    if report.torch_version and not chain.recorded(session, job.id, "runtime", attempt=attempt):
        chain.append(session, job.id, "runtime", {"attempt": attempt, "torch_version": report.torch_version},
                     attempt=attempt)
    for d in report.datasets:
        if not chain.recorded(session, job.id, "dataset", uri=d.uri, digest=d.digest, attempt=attempt):
            chain.append(session, job.id, "dataset", {"attempt": attempt, "uri": d.uri, "digest": d.digest},
                         attempt=attempt)
    tag = report.last_complete_checkpoint
    if tag and not chain.recorded(session, job.id, "checkpoint", tag=tag):
        chain.append(session, job.id, "checkpoint", {"attempt": attempt, "tag": tag, "step": report.step},
                     attempt=attempt)


def record_failure_report(session: Session, job: Job, report: FailureReport) -> Event:
    """A worker rank's last words before it exits: kept as an event for the reconciler and the user."""
    return record_event(
        session, job.id, actor=f"worker:{report.rank}", type="WorkerFailed", attempt=job.current_attempt,
        message=f"rank {report.rank}: {report.failure_class.value}: {report.message}",
        data={"rank": report.rank, "class": report.failure_class.value},
    )


def jobs_by_phase(session: Session) -> dict[str, int]:
    """Count of jobs per phase (every phase listed, zeros included) for /metrics."""
    counts = dict.fromkeys(JOB_PHASES, 0)
    for phase, n in session.execute(select(Job.phase, func.count()).group_by(Job.phase)):
        counts[phase] = n
    return counts


@dataclass(frozen=True)
class JobPerformance:
    """What `/v1/jobs/{id}/goodput` and the per-job gauges report (see `controller.goodput`)."""

    goodput: Goodput
    eta_s: float | None
    mfu: float | None
    tokens_per_s: float | None
    step: int | None


def job_performance(session: Session, job: Job, *, now: datetime | None = None) -> JobPerformance:
    """Goodput since submit (up to the job's end once it has finished), ETA, MFU and tokens/s."""
    rows = session.execute(
        select(Heartbeat.attempt, Heartbeat.time, Heartbeat.step, Heartbeat.last_complete_checkpoint,
               Heartbeat.checkpoint_s).where(Heartbeat.job_id == job.id).order_by(Heartbeat.id)
    ).all()
    beats = [Beat(a, t, s, c, cs) for a, t, s, c, cs in rows]
    attempts = [AttemptTimes(a.number, a.submitted_at, a.started_at, a.finished_at) for a in job.attempts]
    end = job.finished_at or now or utcnow()
    result = goodput(submitted_at=job.created_at, attempts=attempts, beats=beats, now=end)
    last = job.last_heartbeat or {}
    max_steps = (job.spec or {}).get("spec", {}).get("maxSteps")
    eta = None if job.phase in TERMINAL_PHASES else eta_s(beats, max_steps=max_steps)
    return JobPerformance(goodput=result, eta_s=eta, mfu=last.get("mfu"), tokens_per_s=last.get("tokens_per_s"),
                          step=last.get("step"))


def live_jobs(session: Session, *, limit: int) -> list[Job]:
    """The newest `limit` jobs that have not finished (the per-job gauges' bounded label set)."""
    return list(session.scalars(
        select(Job).where(Job.phase.not_in(TERMINAL_PHASES)).order_by(Job.created_at.desc()).limit(limit)
    ).all())
