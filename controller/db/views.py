"""The read side of /v1/jobs: a page of a project's jobs (filtered, newest first) and one job's detail,
read as plain rows with SQLAlchemy Core.

Called by the list and get routes (`controller.api.jobs`) on a connection of their own, once per request,
so these reads are the busiest code of a controller: no mapped objects are built (a page of 50 mapped
`Job`s, or one with its relationships, cost several times the CPU of the queries), and each statement is
built once per shape and then executed with new parameters (building a `select()` cost more than
running it). Every statement here works on a session or a plain connection, PostgreSQL or SQLite.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import cache
from types import SimpleNamespace
from typing import Any

from sqlalchemy import JSON, Connection, Integer, Row, Select, and_, bindparam, exists, func, or_, select
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.functions import FunctionElement

from deepfleet.controller.db.models import Attempt, Job, JobLabel


class _LabelObject(FunctionElement[Any]):
    """A job's labels as one JSON object in key order ({} for none), aggregated in SQL so that a row's
    labels come with the row: `json_object_agg(key, value ORDER BY key)` on PostgreSQL; on SQLite
    `json_group_object` over the rows in the order the subquery reads them, the primary key's (job, key)."""

    type = JSON()
    inherit_cache = True
    name = "label_object"


@compiles(_LabelObject)
def _label_object_postgresql(element: _LabelObject, compiler: Any, **kw: Any) -> str:
    key, value = (compiler.process(c, **kw) for c in element.clauses)
    return f"coalesce(json_object_agg({key}, {value} ORDER BY {key}), '{{}}'::json)"


@compiles(_LabelObject, "sqlite")
def _label_object_sqlite(element: _LabelObject, compiler: Any, **kw: Any) -> str:
    return f"json_group_object({compiler.process(element.clauses, **kw)})"


def _labels_of_row() -> Any:
    return (select(_LabelObject(JobLabel.key, JobLabel.value)).where(JobLabel.job_id == Job.id)
            .correlate(Job).scalar_subquery())


@dataclass(frozen=True)
class JobFilter:
    project: str
    phase: str | None = None
    queue: str | None = None
    labels: dict[str, str] | None = None
    name: str | None = None

    def parameters(self) -> dict[str, Any]:
        """The values `_page` and `_count` statements of this filter's shape are executed with."""
        values: dict[str, Any] = {"project": self.project, "phase": self.phase, "queue": self.queue,
                                  "name": self.name}
        for i, (key, value) in enumerate((self.labels or {}).items()):
            values[f"label_key_{i}"], values[f"label_value_{i}"] = key, value
        return values

    def shape(self) -> tuple[bool, bool, bool, int]:
        """Which filters are set: one statement per shape, whatever the values."""
        return bool(self.phase), bool(self.queue), bool(self.name), len(self.labels or {})


def _filtered(query: Select[Any], phase: bool, queue: bool, name: bool, labels: int) -> Select[Any]:
    query = query.where(Job.project == bindparam("project"))
    if phase:
        query = query.where(Job.phase == bindparam("phase"))
    if queue:
        query = query.where(Job.queue == bindparam("queue"))
    if name:
        query = query.where(Job.name == bindparam("name"))
    for i in range(labels):
        query = query.where(exists().where(JobLabel.job_id == Job.id, JobLabel.key == bindparam(f"label_key_{i}"),
                                           JobLabel.value == bindparam(f"label_value_{i}")))
    return query


def _listed() -> tuple[Any, ...]:
    """A listed row's columns, named and ordered as the API's `JobSummary` fields (so a row is a summary
    as it stands): the summary's columns of `jobs` (no documents), its labels, and the two figures a
    summary shows from the documents, extracted in SQL."""
    return (Job.id, Job.name, Job.project, Job.queue, Job.backend, Job.priority, Job.phase,
            func.coalesce(Job.message, "").label("message"), Job.desired_state,
            Job.current_attempt.label("attempt"), Job.world_size, _labels_of_row().label("labels"),
            Job.created_at, Job.updated_at, Job.finished_at,
            Job.last_heartbeat["step"].as_integer().label("step"),
            Job.spec[("spec", "maxSteps")].as_integer().label("max_steps"))


@cache
def _page(shape: tuple[bool, bool, bool, int], after: bool) -> Select[Any]:
    total = _filtered(select(func.count()).select_from(Job), *shape).scalar_subquery()
    query = (_filtered(select(*_listed(), total.label("total")), *shape)
             .order_by(Job.created_at.desc(), Job.id.desc()).limit(bindparam("limit", type_=Integer)))
    if after:
        created, job_id = bindparam("after_created", type_=Job.created_at.type), bindparam("after_id")
        query = query.where(or_(Job.created_at < created, and_(Job.created_at == created, Job.id < job_id)))
    return query


@cache
def _count(shape: tuple[bool, bool, bool, int]) -> Select[Any]:
    return _filtered(select(func.count()).select_from(Job), *shape)


def list_jobs(
    db: Session | Connection, f: JobFilter, *, limit: int, after: tuple[datetime, str] | None = None
) -> tuple[list[Row[Any]], int]:
    """Newest first, keyset-paginated on (created_at, id); also the total count matching the filter.

    Each row has the columns of `_listed()` and then `total`. One round trip: the count rides along as a
    scalar subquery and the labels as a JSON object per row (a second statement only counts the matches
    when the page is empty); the documents stay in the database.
    """
    values = {**f.parameters(), "limit": limit}
    if after is not None:
        values["after_created"], values["after_id"] = after
    rows = list(db.execute(_page(f.shape(), after is not None), values).all())
    if not rows:
        return [], db.execute(_count(f.shape()), values).scalar_one()
    return rows, rows[0].total


@dataclass(frozen=True)
class JobView:
    """A job as GET /v1/jobs/{id} shows it: `job` has the columns of `_VIEWED` by name (like a mapped `Job`)
    and `labels` (a dict); `attempts` have the attempts' columns (`_ATTEMPT_VIEWED`) by name, in number
    order."""

    job: Row[Any]
    attempts: list[SimpleNamespace]


# What a job's detail shows: every column but the submitter, the claim and the backoff (the reconciler's).
_VIEWED = tuple(c for c in Job.__table__.c if c.name not in ("submitted_by", "not_before", "claimed_by",
                                                             "claim_expires_at"))
_ATTEMPT_VIEWED = tuple(c for c in Attempt.__table__.c if c.name not in ("id", "job_id"))
_ATTEMPT_NAMES = tuple(c.name for c in _ATTEMPT_VIEWED)


@cache
def _job() -> Select[Any]:
    """The job and its labels, once per attempt (a job without attempts: one row, its attempt columns NULL)."""
    attempt = tuple(c.label(f"attempt_{c.name}") for c in _ATTEMPT_VIEWED)
    return (select(*_VIEWED, _labels_of_row().label("labels"), *attempt)
            .select_from(Job).outerjoin(Attempt, Attempt.job_id == Job.id)
            .where(Job.id == bindparam("job_id"), Job.project == bindparam("project")).order_by(Attempt.number))


def view_job(db: Session | Connection, job_id: str, *, project: str) -> JobView | None:
    """The job if it belongs to `project` (another project's job is indistinguishable from none), with its
    attempts joined in: one indexed read, one round trip. A job has a handful of attempts (one per
    restart), so repeating its columns on each of their rows costs less than a second statement."""
    rows = db.execute(_job(), {"job_id": job_id, "project": project}).all()
    if not rows:
        return None
    first = len(_VIEWED) + 1  # the attempt columns' offset
    attempts = [SimpleNamespace(**dict(zip(_ATTEMPT_NAMES, r[first:], strict=True)))
                for r in rows if r.attempt_number is not None]
    return JobView(job=rows[0], attempts=attempts)
