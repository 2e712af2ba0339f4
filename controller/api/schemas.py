"""Response and request bodies of the REST API (the JobSpec itself comes from `controller.spec`, the
worker's Heartbeat/FailureReport from `deepfleet.worker.spec`).

Used by the routers in `controller/api` and, through the published OpenAPI document, by the CLI's
HTTP client and the web page. Field names are snake_case JSON; times are UTC ISO-8601.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deepfleet.controller.db.models import Attempt, Event, Heartbeat, Job
from deepfleet.controller.db.views import JobView


class _Out(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)


class ErrorBody(_Out):
    """Every 4xx answer: a summary and, for bad input, one "<field.path>: <problem>; <fix>" line each."""

    detail: str
    errors: list[str] = []


class AttemptOut(_Out):
    number: int
    backend: str
    run_name: str
    """Deterministic backend name of the run; also the folder of its logs."""
    phase: str
    nodes: int | None
    exit_codes: dict[str, int]
    failure_class: str | None
    message: str
    submitted_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None

    @classmethod
    def of(cls, row: Attempt) -> AttemptOut:
        return cls(**attempt_fields(row))


class JobSummary(_Out):
    id: str
    name: str
    project: str
    queue: str
    backend: str
    priority: str
    phase: str
    """PENDING, ADMITTED, RUNNING, RESTARTING, SUCCEEDED, FAILED or CANCELLED."""
    message: str
    """Why the job is in its phase."""
    desired_state: Literal["run", "cancel_requested"]
    attempt: int
    world_size: int
    labels: dict[str, str]
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    step: int | None
    """Optimizer steps completed, from the newest heartbeat (null: none yet)."""
    max_steps: int | None
    """The job's step budget (`spec.maxSteps`), when set: with `step`, the progress."""

    @classmethod
    def of(cls, job: Job) -> JobSummary:
        return cls(**summary_fields(job, labels={label.key: label.value for label in job.labels},
                                    step=(job.last_heartbeat or {}).get("step"),
                                    max_steps=(job.spec or {}).get("spec", {}).get("maxSteps")))

    @classmethod
    def listed(cls, row: Any) -> JobSummary:
        """A listing's row (`controller.db.views.list_jobs`)."""
        return cls(**listed_fields(row))


# The answers of the read routes are built as plain dicts of these fields, in each model's field order,
# and serialized without building the models (`controller.api.deps.json_body`); the models describe
# them in the OpenAPI document, and a test checks that both give the same bytes.

def summary_fields(job: Any, *, labels: dict[str, str], step: Any, max_steps: Any) -> dict[str, Any]:
    """A `JobSummary`'s fields, in its order, of a job (a mapped `Job`, a `ListedJob` or a row of its columns)."""
    return {"id": job.id, "name": job.name, "project": job.project, "queue": job.queue, "backend": job.backend,
            "priority": job.priority, "phase": job.phase, "message": job.message or "",
            "desired_state": job.desired_state, "attempt": job.current_attempt, "world_size": job.world_size,
            "labels": labels, "created_at": job.created_at, "updated_at": job.updated_at,
            "finished_at": job.finished_at, "step": step, "max_steps": max_steps}


def listed_fields(row: Any, names: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A `JobSummary`'s fields of a listing's row (`controller.db.views.list_jobs`), whose columns are
    named and ordered as the fields, then `total` (left out); `names`: the rows' names less `total`,
    found once per page. Built by zip, at C speed: reading 17 attributes of 50 rows cost more."""
    return dict(zip(names or row._fields[:-1], row, strict=False))


def list_fields(rows: list[Any], *, total: int, next_cursor: str | None) -> dict[str, Any]:
    """A `JobList`'s fields of a listing's rows."""
    names = rows[0]._fields[:-1] if rows else ()
    return {"items": [listed_fields(r, names) for r in rows], "total": total, "next_cursor": next_cursor}


def detail_fields(job: Any, *, labels: dict[str, str], attempts: list[Any]) -> dict[str, Any]:
    """A `JobDetail`'s fields, in its order, of a job (a mapped `Job` or a row of its columns) and its attempts."""
    heartbeat = job.last_heartbeat
    return {**summary_fields(job, labels=labels, step=(heartbeat or {}).get("step"),
                             max_steps=(job.spec or {}).get("spec", {}).get("maxSteps")),
            "spec": _hide_env(job.spec), "spec_version": job.spec_version, "gpus": job.gpus,
            "restart_counts": dict(job.restart_counts or {}), "last_heartbeat": heartbeat,
            "last_heartbeat_at": job.last_heartbeat_at, "attempts": [attempt_fields(a) for a in attempts],
            "privacy": PrivacyOut.of(heartbeat), "registration": RegistrationOut.of(job), "endpoint": job.endpoint}


def view_fields(view: JobView) -> dict[str, Any]:
    """A `JobDetail`'s fields of a job read by `controller.db.views.view_job`."""
    return detail_fields(view.job, labels=view.job.labels, attempts=view.attempts)


def attempt_fields(row: Any) -> dict[str, Any]:
    """An `AttemptOut`'s fields, in its order."""
    return {"number": row.number, "backend": row.backend, "run_name": row.run_name, "phase": row.phase,
            "nodes": row.nodes, "exit_codes": dict(row.exit_codes or {}), "failure_class": row.failure_class,
            "message": row.message or "", "submitted_at": row.submitted_at, "started_at": row.started_at,
            "finished_at": row.finished_at}


class PrivacyOut(_Out):
    """What a differentially private job (`deepfleet_differential_privacy`) has spent, from its newest
    heartbeat: the (epsilon, delta) guarantee of the model trained so far."""

    epsilon: float
    """Epsilon spent so far, at `delta`."""
    delta: float
    accountant: str | None
    """The privacy accountant that computed it (rdp: Renyi DP, prv: privacy random variables)."""
    step: int
    """The optimizer step it was computed at."""

    @classmethod
    def of(cls, heartbeat: dict[str, Any] | None) -> PrivacyOut | None:
        beat = heartbeat or {}
        if beat.get("dp_epsilon") is None or beat.get("dp_delta") is None:
            return None
        return cls(epsilon=beat["dp_epsilon"], delta=beat["dp_delta"], accountant=beat.get("dp_accountant"),
                   step=beat.get("step", 0))


class RegistrationOut(_Out):
    """The model registration a job asked for (`spec.registerModel`), done once the job SUCCEEDED."""

    state: Literal["pending", "registered", "failed"]
    """pending: the controller will register it; registered; failed (`error` says why; the job's phase
    is unaffected)."""
    name: str
    """Registered model name."""
    registry: str | None = None
    """mlflow or azureml."""
    version: str | None = None
    uri: str | None = None
    """The registry's name for the entry (models:/NAME/VERSION, azureml:NAME:VERSION)."""
    source: str | None = None
    """Where the registered file is stored."""
    tries: int = 0
    error: str | None = None
    """The last try's failure."""
    retry_at: str | None = None
    registered_at: str | None = None

    @classmethod
    def of(cls, job: Any) -> RegistrationOut | None:
        if job.registration_state is None:
            return None
        known = set(cls.model_fields) - {"state"}
        return cls(state=job.registration_state, **{k: v for k, v in (job.registration or {}).items() if k in known})


class JobDetail(JobSummary):
    spec: dict[str, Any]
    """The JobSpec document as submitted (immutable), with `spec.env` values hidden."""
    spec_version: str
    gpus: int
    restart_counts: dict[str, int]
    """Restarts so far per failure class."""
    last_heartbeat: dict[str, Any] | None
    last_heartbeat_at: datetime | None
    attempts: list[AttemptOut]
    privacy: PrivacyOut | None = None
    """Differential privacy spent so far (null: the job does not train with DP-SGD, or has not stepped)."""
    registration: RegistrationOut | None = None
    """The model registration (null: the spec asks for none, or the job has not succeeded)."""
    endpoint: str | None = None
    """A RUNNING ServingJob's URL (POST <endpoint>/v1/completions); null otherwise."""

    @classmethod
    def of(cls, job: Job) -> JobDetail:  # type: ignore[override]
        return cls(**detail_fields(job, labels={label.key: label.value for label in job.labels},
                                   attempts=job.attempts))


HIDDEN = "(hidden)"


def _hide_env(document: dict[str, Any]) -> dict[str, Any]:
    """The spec with every plain `spec.env` value replaced: env carries credentials, and readers of a job
    (viewers, the web page, logs of API clients) must not see them. A secret reference (`{secret: name}`)
    holds no value and is shown as it is."""
    env = (document.get("spec") or {}).get("env")
    if not env:
        return document
    shown = {k: v if isinstance(v, dict) else HIDDEN for k, v in env.items()}
    return {**document, "spec": {**document["spec"], "env": shown}}


class JobList(_Out):
    items: list[JobSummary]
    total: int
    """Jobs matching the filter, over all pages."""
    next_cursor: str | None
    """Pass as `cursor` for the next page; null on the last page."""


class EventOut(_Out):
    id: int
    time: datetime
    actor: str
    type: str
    message: str
    attempt: int | None

    @classmethod
    def of(cls, row: Event) -> EventOut:
        return cls(id=row.id, time=row.time, actor=row.actor, type=row.type, message=row.message or "",
                   attempt=row.attempt)


class EventList(_Out):
    items: list[EventOut]
    next_after: int | None
    """Pass as `after` to read newer events; null when this page was not full."""


class MetricPoint(_Out):
    time: datetime
    attempt: int
    step: int
    loss: float | None
    lr: float | None
    grad_norm: float | None
    tokens_per_s: float | None
    last_complete_checkpoint: str | None
    mfu: float | None = None
    checkpoint_s: float | None = None
    dp_epsilon: float | None = None
    """Epsilon spent by this step under DP-SGD, at `dp_delta` (null: not differentially private)."""
    dp_delta: float | None = None

    @classmethod
    def of(cls, row: Heartbeat) -> MetricPoint:
        return cls(time=row.time, attempt=row.attempt, step=row.step, loss=row.loss, lr=row.lr,
                   grad_norm=row.grad_norm, tokens_per_s=row.tokens_per_s,
                   last_complete_checkpoint=row.last_complete_checkpoint, mfu=row.mfu,
                   checkpoint_s=row.checkpoint_s, dp_epsilon=row.dp_epsilon, dp_delta=row.dp_delta)


class Metrics(_Out):
    job_id: str
    points: list[MetricPoint]
    """Heartbeats in time order (the newest `limit`)."""


class JobGoodput(_Out):
    """Goodput of a job since submit, with the lost time by cause (see `controller.goodput`)."""

    job_id: str
    goodput: float | None
    """Productive training time / wall time since submit (0..1; null before any wall time)."""
    wall_s: float
    """Seconds since submit (until the job finished, once it has)."""
    productive_s: float
    """Seconds of training kept: not lost to any cause below."""
    lost_s: dict[str, float]
    """Seconds lost by cause: queueing, start_up, restarts, recomputation, checkpoint_stalls, other."""
    mfu: float | None
    """Model FLOPs utilization of the newest heartbeat (null unless the job enables the FLOPs profiler)."""
    tokens_per_s: float | None
    """Training throughput of the newest heartbeat."""
    eta_s: float | None
    """Seconds to spec.maxSteps at the newest heartbeats' step rate (null: unknown or finished)."""
    step: int | None


class HeartbeatAck(_Out):
    desired_state: Literal["run", "cancel_requested"]
    """What the controller wants of the job now; a worker may stop early on cancel_requested."""


class TokenCreate(BaseModel):
    """A new API token for the caller's project."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: str = Field(min_length=1, max_length=128)
    """What the token is for (shown in listings and events)."""
    role: Literal["admin", "member", "viewer"] = "member"
    project: str | None = Field(None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """Must be the caller's project; null means the caller's project."""
    expires_in_days: float | None = Field(None, gt=0, le=3650)
    """Lifetime; null uses the controller's default (DEEPFLEET_TOKEN_TTL_DAYS)."""


class TokenCreated(_Out):
    id: str
    name: str
    project: str
    role: str
    expires_at: datetime | None
    token: str
    """The bearer token. Shown once: only its hash is stored."""


class QueueOut(_Out):
    name: str
    max_processes: int | None
    """Most training processes its admitted jobs may hold at once; null: unlimited."""
    max_gpus: int | None
    """Most GPUs its admitted jobs may hold at once; null: unlimited."""


class QueueQuota(BaseModel):
    """Quotas of a queue; null means unlimited."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_processes: int | None = Field(None, ge=0, le=1_000_000)
    max_gpus: int | None = Field(None, ge=0, le=1_000_000)


class ProvenanceRecordOut(BaseModel):
    """One link of the chain: `hash` is sha256 of the canonical JSON of every other field."""

    job_id: str
    seq: int
    kind: str = Field(description="submit | attempt | runtime | dataset | checkpoint | registration")
    attempt: int | None
    time: str
    data: dict[str, Any]
    prev_hash: str
    hash: str


class Provenance(BaseModel):
    job_id: str
    head: str | None = Field(description="The newest record's hash (what an exported model carries).")
    verified: bool = Field(description="Every record's hash and link recomputed and found intact.")
    problems: list[str]
    records: list[ProvenanceRecordOut]
