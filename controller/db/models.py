"""The controller's tables, as SQLAlchemy 2 typed ORM models (one metadata, shared by Alembic).

Used by the API (records intent: jobs, cancel requests, events, heartbeats, tokens), the reconciler
and scheduler (claims jobs, records attempts and phase changes) and `migrations/env.py` (autogenerate
and the drift test compare against `Base.metadata`). Portable between PostgreSQL (production) and
SQLite (the embedded default): plain JSON, string enums checked by CHECK constraints, and UTC
timestamps normalized by `UTCDateTime` (SQLite drops the zone).

Desired state lives here (`Job.desired_state`), observed state in the backend. A replica claims a
job by setting `claimed_by`/`claim_expires_at` (Postgres: `SELECT ... FOR UPDATE SKIP LOCKED`),
and cluster-wide singletons (the scheduler) hold a row in `leases`.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

ROLES = ("admin", "member", "viewer")
DESIRED_STATES = ("run", "cancel_requested")
PRIORITIES = ("low", "normal", "high")
# The values of `controller.lifecycle.Phase`, repeated here because the API (which must not reach the
# backends that lifecycle imports) filters and counts by phase; a test keeps the two identical.
JOB_PHASES = ("PENDING", "ADMITTED", "RUNNING", "RESTARTING", "SUCCEEDED", "FAILED", "CANCELLED")
TERMINAL_PHASES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
REGISTRATION_STATES = ("pending", "registered", "failed")

# Deterministic constraint names, so autogenerate and downgrades see the same names on every database.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    """Aware UTC now (the default of every timestamp column)."""
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every database (SQLite stores it naive; we re-attach UTC)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column; use datetime.now(timezone.utc)")
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def _one_of(column: str, values: tuple[str, ...], name: str) -> CheckConstraint:
    listed = ", ".join(f"'{v}'" for v in values)
    return CheckConstraint(f"{column} IN ({listed})", name=name)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Project(Base):
    """A tenant: tokens are bound to one, and a token never sees another project's jobs."""

    __tablename__ = "projects"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiToken(Base):
    """A bearer token bound to a project and a role; only sha256 of its secret is stored."""

    __tablename__ = "api_tokens"
    __table_args__ = (_one_of("role", ROLES, "role"),)

    id: Mapped[str] = mapped_column(String(12), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    project: Mapped[str] = mapped_column(ForeignKey("projects.name", ondelete="CASCADE"), index=True)
    role: Mapped[str] = mapped_column(String(16))
    secret_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    created_by: Mapped[str | None] = mapped_column(String(64))
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class Queue(Base):
    """An admission queue with optional quotas (None: unlimited) on processes and GPUs in use."""

    __tablename__ = "queues"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    max_processes: Mapped[int | None] = mapped_column(Integer)
    max_gpus: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Job(Base):
    """One submitted job: the immutable spec as submitted, plus the controller's desired and recorded state."""

    __tablename__ = "jobs"
    __table_args__ = (
        _one_of("desired_state", DESIRED_STATES, "desired_state"),
        _one_of("priority", PRIORITIES, "priority"),
        # Listing is "newest first within a project"; the cursor is (created_at, id).
        Index("ix_jobs_project_created", "project", "created_at", "id"),
        Index("ix_jobs_phase", "phase"),
        # Admission reads each base priority's oldest PENDING jobs of one backend (a window, not the queue).
        Index("ix_jobs_admission", "phase", "backend", "priority", "created_at", "id"),
        Index("ix_jobs_queue_phase", "queue", "phase"),
        Index("ix_jobs_registration_state", "registration_state"),
        _one_of("registration_state", REGISTRATION_STATES, "registration_state"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(63))
    project: Mapped[str] = mapped_column(ForeignKey("projects.name", ondelete="CASCADE"))
    queue: Mapped[str] = mapped_column(ForeignKey("queues.name"))
    backend: Mapped[str] = mapped_column(String(16))
    priority: Mapped[str] = mapped_column(String(8))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    """The JobSpec document exactly as validated at submission (camelCase); never updated."""
    spec_version: Mapped[str] = mapped_column(String(32))
    world_size: Mapped[int] = mapped_column(Integer)
    """Training processes at full size (job_world_size): what the queue's process quota counts."""
    gpus: Mapped[int] = mapped_column(Integer, default=0)
    """GPUs at full size (nodes x resources.gpu): what the queue's GPU quota counts."""
    phase: Mapped[str] = mapped_column(String(16))
    """A `controller.lifecycle.Phase` value."""
    message: Mapped[str] = mapped_column(Text, default="")
    """Why the job is in its phase (the last transition's message)."""
    desired_state: Mapped[str] = mapped_column(String(20), default="run")
    current_attempt: Mapped[int] = mapped_column(Integer, default=0)
    restart_counts: Mapped[dict[str, int]] = mapped_column(JSON, default=dict)
    """Restarts so far per failure class (`FailureClass` value -> count)."""
    not_before: Mapped[datetime | None] = mapped_column(UTCDateTime)
    """Earliest time the next attempt may be submitted (restart backoff)."""
    last_heartbeat: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """Summary of the newest heartbeat (step, loss, tokens/s, last checkpoint, time)."""
    last_heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    submitted_by: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    claimed_by: Mapped[str | None] = mapped_column(String(64))
    """The controller replica working on this job now (None: unclaimed)."""
    claim_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    registration_state: Mapped[str | None] = mapped_column(String(16))
    """`spec.registerModel` of a SUCCEEDED job: pending (the reconciler registers it), registered or
    failed; None for a job that asks for none (or has not succeeded)."""
    registration: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    """What the registration did: registry, name, version, uri, tries, error (`controller.registration`)."""
    endpoint: Mapped[str | None] = mapped_column(String(255))
    """A RUNNING ServingJob's URL, as its backend reports it; None for a training job or a stopped one."""

    labels: Mapped[list[JobLabel]] = relationship(
        back_populates="job", cascade="all, delete-orphan", lazy="selectin", order_by="JobLabel.key"
    )
    """In key order, as the API shows them (`controller.db.views` aggregates them in that order too)."""
    attempts: Mapped[list[Attempt]] = relationship(
        back_populates="job", cascade="all, delete-orphan", order_by="Attempt.number"
    )


class JobLabel(Base):
    """One metadata label of a job; a table (not JSON) so label filters are an indexed, portable join."""

    __tablename__ = "job_labels"
    __table_args__ = (Index("ix_job_labels_key_value", "key", "value"),)

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    key: Mapped[str] = mapped_column(String(317), primary_key=True)
    value: Mapped[str] = mapped_column(String(63))

    job: Mapped[Job] = relationship(back_populates="labels")


class Attempt(Base):
    """One run of a job on a backend (a new attempt after each restart, with a new backend name)."""

    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("job_id", "number", name="uq_attempts_job_number"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    backend: Mapped[str] = mapped_column(String(16))
    run_name: Mapped[str] = mapped_column(String(63))
    """Deterministic backend name of the run (df-<job>-<id8>-a<n>)."""
    phase: Mapped[str] = mapped_column(String(16))
    """A `controller.backends.base.RunPhase` value as last observed."""
    nodes: Mapped[int | None] = mapped_column(Integer)
    exit_codes: Mapped[dict[str, int]] = mapped_column(JSON, default=dict)
    """Node index (as a string key) -> exit code, for the nodes whose exit is known."""
    failure_class: Mapped[str | None] = mapped_column(String(32))
    message: Mapped[str] = mapped_column(Text, default="")
    submitted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    job: Mapped[Job] = relationship(back_populates="attempts")


class Event(Base):
    """The audit trail: every state change of a job, with who did it and when."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    time: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    actor: Mapped[str] = mapped_column(String(128))
    """"token:<id>", "worker:<rank>" or a controller replica id."""
    type: Mapped[str] = mapped_column(String(64))
    """Short reason, CamelCase (Submitted, CancelRequested, Admitted, Restarting, Failed, ...)."""
    message: Mapped[str] = mapped_column(Text, default="")
    attempt: Mapped[int | None] = mapped_column(Integer)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class Heartbeat(Base):
    """A training heartbeat (time series per job): what GET /v1/jobs/{id}/metrics returns."""

    __tablename__ = "heartbeats"
    __table_args__ = (Index("ix_heartbeats_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    time: Mapped[datetime] = mapped_column(UTCDateTime)
    """When the worker took it."""
    received_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    lr: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    last_complete_checkpoint: Mapped[str | None] = mapped_column(String(255))
    mfu: Mapped[float | None] = mapped_column(Float)
    """Model FLOPs utilization of the newest step (None unless the job enables the FLOPs profiler)."""
    checkpoint_s: Mapped[float | None] = mapped_column(Float)
    """Seconds this attempt has spent saving checkpoints so far (goodput's checkpoint stalls)."""
    dp_epsilon: Mapped[float | None] = mapped_column(Float)
    """Epsilon spent so far under DP-SGD, at `dp_delta` (None: the run is not differentially private)."""
    dp_delta: Mapped[float | None] = mapped_column(Float)


class Lease(Base):
    """A named, expiring lease (e.g. "scheduler"): one controller replica holds it at a time."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    holder: Mapped[str] = mapped_column(String(64))
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    renewed_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class StoredSecret(Base):
    """A project's secret for `env` references on the local backend (`controller.db.secrets`): only the
    Fernet token of the value is stored, and no API answer ever carries it."""

    __tablename__ = "secrets"

    project: Mapped[str] = mapped_column(ForeignKey("projects.name", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    ciphertext: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_by: Mapped[str | None] = mapped_column(String(64))


class ProvenanceRecord(Base):
    """One link of a job's append-only provenance chain (`controller.provenance`): never updated; each
    row holds the previous row's hash, so `verify` detects an edited or removed row."""

    __tablename__ = "provenance_records"
    __table_args__ = (UniqueConstraint("job_id", "seq", name="uq_provenance_records_job_seq"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    """0, 1, 2, ... within the job."""
    kind: Mapped[str] = mapped_column(String(16))
    """submit | attempt | runtime | dataset | checkpoint | registration."""
    attempt: Mapped[int | None] = mapped_column(Integer)
    time: Mapped[str] = mapped_column(String(40))
    """ISO 8601 UTC text, exactly as hashed."""
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))
