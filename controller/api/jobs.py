"""/v1/jobs: submit, list, get, cancel, events, logs and metrics of a project's jobs.

Mounted by `create_app`. Handlers record intent only: a submit stores a PENDING job, a cancel sets
the desired state; the reconciler does the rest. Every change writes an event (who, when).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator
from datetime import datetime
from typing import Annotated, Any, Literal

import anyio.to_thread
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import Field
from sqlalchemy import Connection, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from deepfleet.controller.api.deps import (
    ApiError,
    PrincipalDep,
    SessionDep,
    SettingsDep,
    job_not_found,
    json_body,
    project_job,
    read_json,
    require,
)
from deepfleet.controller.api.logs import LogReader, LogUnavailable, follow, tail_bytes
from deepfleet.controller.api.schemas import (
    ErrorBody,
    EventList,
    EventOut,
    JobDetail,
    JobGoodput,
    JobList,
    JobSummary,
    MetricPoint,
    Metrics,
    Provenance,
    ProvenanceRecordOut,
    list_fields,
    view_fields,
)
from deepfleet.controller.bounds import MAX_DEPTH, DocumentTooLarge, check_document, short_errors
from deepfleet.controller.db import jobs as store
from deepfleet.controller.db import secrets as secret_store
from deepfleet.controller.db import views
from deepfleet.controller.db.models import JOB_PHASES, TERMINAL_PHASES, Attempt, Event, Heartbeat, Job
from deepfleet.controller.policy import submit_errors
from deepfleet.controller.spec import DNS_LABEL, AnyJob, SpecError, parse_job_yaml, secret_refs, validate_job

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

YAML_TYPES = {"application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml"}
MAX_LABEL_FILTERS = 16
LABEL_HELP = "key=value; repeat to require several (at most 16)."
# A label key (253 + "/" + 63 at most) "=" a value (63 at most).
LabelFilter = Annotated[str, Field(pattern=r"^[^=]+=.*$", max_length=317)]
PhaseParam = Literal[JOB_PHASES]  # type: ignore[valid-type]

ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "Missing, invalid or expired token."},
    404: {"model": ErrorBody, "description": "No such job in the token's project."},
}


def _spec_request_body() -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "description": "A TrainingJob or ServingJob document (see `deepfleet schema`), as YAML or JSON.",
            "content": {
                "application/yaml": {"schema": {"type": "string"}},
                "application/json": {"schema": {"oneOf": [{"$ref": "#/components/schemas/TrainingJob"},
                                                          {"$ref": "#/components/schemas/ServingJob"}]}},
            },
        }
    }


def _parse_body(body: bytes, content_type: str) -> AnyJob:
    media = content_type.split(";")[0].strip().lower()
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "body is not UTF-8 text; send the job as UTF-8 YAML or JSON") from None
    try:
        if media == "application/json":
            try:
                document = json.loads(text)
                check_document(document)
            except json.JSONDecodeError as e:
                raise SpecError([f"(document): malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}; "
                                 "fix the syntax"]) from None
            except RecursionError:
                raise SpecError([f"(document): more than {MAX_DEPTH} levels of nesting; shorten it"]) from None
            except DocumentTooLarge as e:
                raise SpecError([str(e)]) from None
            return validate_job(document, read_files=False)
        if media in YAML_TYPES or media == "":
            return parse_job_yaml(text, read_files=False)
    except SpecError as e:
        raise ApiError(422, "invalid job spec", errors=short_errors(e.errors)) from None
    raise ApiError(415, f"unsupported content type {media!r}; send application/yaml or application/json")


def _missing_secrets(session: Session, spec: AnyJob) -> list[str]:
    """A local job's references to secrets its project's store lacks, one line each."""
    project = spec.metadata.project
    return [f"spec.env.{var}.secret: secret {ref.secret!r} is not in project {project!r}'s secret store; set it "
            f"with `deepfleet secret set {ref.secret}` or drop the reference"
            for var, ref in secret_refs(spec).items() if not secret_store.exists(session, project=project,
                                                                                 name=ref.secret)]


@router.post(
    "", status_code=201, response_model=JobDetail, openapi_extra=_spec_request_body(),
    responses={**ERRORS, 403: {"model": ErrorBody}, 413: {"model": ErrorBody}, 415: {"model": ErrorBody},
               422: {"model": ErrorBody}},
    summary="Submit a job",
)
async def submit_job(request: Request, principal: PrincipalDep, session: SessionDep, settings: SettingsDep) -> JobDetail:
    require(principal, "member", "submit jobs")
    body = await request.body()
    spec = await anyio.to_thread.run_sync(_parse_body, body, request.headers.get("content-type", ""),
                                          limiter=getattr(request.app.state, "parse_limiter", None))
    if spec.metadata.project != principal.project:
        raise ApiError(403, "token project mismatch", errors=[
            f"metadata.project: this token belongs to project {principal.project!r}, not "
            f"{spec.metadata.project!r}; submit with a token of that project or change metadata.project"])
    policy = request.app.state.policies.for_project(spec.metadata.project)
    refused = submit_errors(spec, policy=policy,
                            default_namespace=settings.k8s_namespace, factory_modules=tuple(settings.factory_modules))
    if spec.spec.backend == "local" and secret_refs(spec):
        refused += await run_in_threadpool(_missing_secrets, session, spec)
    if refused:
        raise ApiError(422, "job not allowed for this project", errors=refused)

    def create() -> JobDetail:
        try:
            job = store.create_job(session, spec, actor=principal.actor, backends=settings.backends,
                                   default_namespace=settings.k8s_namespace, allowed_claims=policy.claims)
        except store.UnknownReference as e:
            raise ApiError(422, "invalid job spec", errors=e.errors) from None
        session.commit()
        return JobDetail.of(job)

    return await run_in_threadpool(create)


def _encode_cursor(job: Any) -> str:
    raw = json.dumps([job.created_at.isoformat(), job.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        created, job_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        when = datetime.fromisoformat(created)
        if when.tzinfo is None or not isinstance(job_id, str):
            raise ValueError(cursor)
        return when, job_id
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise ApiError(422, "invalid cursor", errors=[
            "query.cursor: not a cursor from this API; pass the next_cursor of a previous page"]) from None


def _labels(label: list[str]) -> dict[str, str]:
    out = {}
    for i, item in enumerate(label):
        key, sep, value = item.partition("=")
        if len(item) > 317:  # a label key (253 + "/" + 63 at most) "=" a value (63)
            raise ApiError(422, "invalid label filter", errors=[f"query.label[{i}]: longer than any label; "
                                                                "shorten it"])
        if not sep or not key:
            raise ApiError(422, "invalid label filter", errors=[f"query.label[{i}]: {item!r} is not key=value; "
                                                                "write it like team=nlp"])
        out[key] = value
    return out


@router.get("", response_model=JobList, responses={**ERRORS, 422: {"model": ErrorBody}}, summary="List jobs")
async def list_jobs(
    request: Request,
    principal: PrincipalDep,
    project: Annotated[str | None, Query(max_length=63, pattern=DNS_LABEL,
                                         description="Only this project (must be the token's own).")] = None,
    phase: Annotated[PhaseParam | None, Query(description="Only jobs in this phase.")] = None,
    queue: Annotated[str | None, Query(max_length=63, pattern=DNS_LABEL)] = None,
    name: Annotated[str | None, Query(max_length=63, pattern=DNS_LABEL)] = None,
    label: Annotated[list[LabelFilter], Query(max_length=MAX_LABEL_FILTERS, description=LABEL_HELP)] = [],  # noqa: B006
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=512, pattern=r"^[A-Za-z0-9_-]+$",
                                        description="next_cursor of the previous page.")] = None,
) -> Response:
    if project is not None and project != principal.project:
        return Response(json_body(list_fields([], total=0, next_cursor=None)),  # another project's jobs are invisible
                        media_type="application/json")
    f = views.JobFilter(project=principal.project, phase=phase, queue=queue, labels=_labels(label), name=name)
    after = _decode_cursor(cursor) if cursor else None

    def page(connection: Connection) -> dict[str, Any]:
        rows, total = views.list_jobs(connection, f, limit=limit, after=after)
        return list_fields(rows, total=total, next_cursor=_encode_cursor(rows[-1]) if len(rows) == limit else None)

    return await read_json(request, page)


@router.get("/{job_id}", response_model=JobDetail, responses=ERRORS, summary="Get a job")
async def get_job(job_id: str, request: Request, principal: PrincipalDep) -> Response:
    def detail(connection: Connection) -> dict[str, Any]:
        view = views.view_job(connection, job_id, project=principal.project)
        if view is None:
            raise job_not_found(job_id)
        return view_fields(view)

    return await read_json(request, detail)


@router.post(
    "/{job_id}/cancel", status_code=202, response_model=JobSummary,
    responses={**ERRORS, 403: {"model": ErrorBody}, 409: {"model": ErrorBody}}, summary="Request a cancel",
)
def cancel_job(job_id: str, principal: PrincipalDep, session: SessionDep) -> JobSummary:
    job = project_job(session, principal, job_id)
    require(principal, "member", "cancel jobs")
    try:
        store.request_cancel(session, job, actor=principal.actor)
    except store.Conflict as e:
        raise ApiError(409, str(e)) from None
    session.commit()
    return JobSummary.of(job)


@router.get("/{job_id}/events", response_model=EventList, responses=ERRORS, summary="A job's events")
def job_events(
    job_id: str, principal: PrincipalDep, session: SessionDep,
    after: Annotated[int, Query(ge=0, le=2**62, description="Only events with a larger id.")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> EventList:
    job = project_job(session, principal, job_id)
    rows = session.scalars(
        select(Event).where(Event.job_id == job.id, Event.id > after).order_by(Event.id).limit(limit)
    ).all()
    return EventList(items=[EventOut.of(e) for e in rows], next_after=rows[-1].id if len(rows) == limit else None)


@router.get("/{job_id}/provenance", response_model=Provenance, responses=ERRORS, summary="A job's provenance")
def job_provenance(job_id: str, principal: PrincipalDep, session: SessionDep) -> Provenance:
    """The job's provenance chain, oldest record first, and whether every hash and link still holds."""
    from deepfleet.controller.db import provenance as chain

    job = project_job(session, principal, job_id)
    rows = [chain.as_dict(r) for r in chain.records(session, job.id)]
    problems = chain.verify(session, job.id)
    return Provenance(job_id=job.id, head=rows[-1]["hash"] if rows else None, verified=not problems,
                      problems=problems, records=[ProvenanceRecordOut(**r) for r in rows])


@router.get("/{job_id}/metrics", response_model=Metrics, responses=ERRORS, summary="A job's training metrics")
def job_metrics(
    job_id: str, principal: PrincipalDep, session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> Metrics:
    job = project_job(session, principal, job_id)
    rows = session.scalars(
        select(Heartbeat).where(Heartbeat.job_id == job.id).order_by(Heartbeat.id.desc()).limit(limit)
    ).all()
    return Metrics(job_id=job.id, points=[MetricPoint.of(r) for r in reversed(rows)])


@router.get("/{job_id}/goodput", response_model=JobGoodput, responses=ERRORS,
            summary="A job's goodput, lost time by cause, MFU, throughput and ETA")
def job_goodput(job_id: str, principal: PrincipalDep, session: SessionDep) -> JobGoodput:
    job = project_job(session, principal, job_id)
    perf = store.job_performance(session, job)
    g = perf.goodput
    return JobGoodput(job_id=job.id, goodput=g.goodput, wall_s=g.wall_s, productive_s=g.productive_s,
                      lost_s=g.lost_s, mfu=perf.mfu, tokens_per_s=perf.tokens_per_s, eta_s=perf.eta_s,
                      step=perf.step)


def _run(session: Any, job: Job, *, attempt: int | None) -> Attempt:
    number = job.current_attempt if attempt is None else attempt
    run = session.scalars(select(Attempt).where(Attempt.job_id == job.id, Attempt.number == number)).one_or_none()
    if run is None:
        raise ApiError(404, f"job {job.id} has no attempt {number} yet; no logs to show")
    return run


# The log route answers text/plain; its errors are JSON like every other route's.
JSON_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": spec["description"],
           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
    for code, spec in {**ERRORS, 422: {"description": "Invalid query parameters."}}.items()
}


@router.get(
    "/{job_id}/logs", response_class=PlainTextResponse, responses=JSON_ERRORS,
    summary="A job's log (one node of one attempt); tail it or follow it",
)
def job_logs(
    job_id: str, request: Request, principal: PrincipalDep, session: SessionDep, settings: SettingsDep,
    node: Annotated[int, Query(ge=0, le=100_000)] = 0,
    attempt: Annotated[int | None, Query(ge=0, le=1_000_000, description="Default: the current attempt.")] = None,
    tail: Annotated[int | None, Query(ge=0, le=1_000_000, description="Only the last N lines.")] = None,
    follow_: Annotated[bool, Query(alias="follow", description="Keep streaming until the job finishes.")] = False,
) -> StreamingResponse:
    job = project_job(session, principal, job_id)
    run = _run(session, job, attempt=attempt)
    reader: LogReader | None = request.app.state.log_reader
    if reader is not None:
        return _from_backend(reader, run, node=node, tail=tail, follow=follow_, max_bytes=settings.log_max_bytes)
    path = request.app.state.log_locator(run.run_name, node)
    head, offset = (b"", 0)
    if path.exists():
        head, offset = tail_bytes(path, lines=tail, max_bytes=settings.log_max_bytes)
    elif not follow_:
        raise ApiError(404, f"no log for node {node} of job {job.id} yet")
    if not follow_:
        return PlainTextResponse(head.decode("utf-8", errors="replace"))
    job_key = job.id

    async def finished() -> bool:
        return await run_in_threadpool(_is_finished, request.app.state.sessions, job_key)

    async def stream():  # noqa: ANN202 - an async generator of bytes
        if head:
            yield head
        async for chunk in follow(path, offset=offset, finished=finished,
                                  poll_s=request.app.state.log_poll_s):
            if await request.is_disconnected():
                return
            yield chunk

    return StreamingResponse(stream(), media_type="text/plain; charset=utf-8")


def _from_backend(reader: LogReader, run: Attempt, *, node: int, tail: int | None, follow: bool,
                  max_bytes: int) -> StreamingResponse:
    """The log as the run's backend serves it (`Backend.logs()` behind the reader). Runs in the
    threadpool: the backends' clients block."""
    lines = reader(run.backend, run.run_name, node=node, tail=tail, follow=follow)
    try:
        first = next(lines, "")  # the run's "no such log" surfaces here, while a 404 can still be sent
    except LogUnavailable as e:
        raise ApiError(404, str(e)) from None
    if not follow:
        body, size = [first], len(first)
        for line in lines:
            body.append(line)
            size += len(line)
            while size > max_bytes and len(body) > 1:  # keep the newest lines within the limit
                size -= len(body.pop(0))
        return PlainTextResponse("".join(body)[-max_bytes:])

    def stream() -> Iterator[bytes]:
        yield first.encode()
        try:
            for line in lines:
                yield line.encode()
        except LogUnavailable as e:  # the run went away mid-stream: say so as the last line
            yield f"(log ended: {e})\n".encode()

    return StreamingResponse(stream(), media_type="text/plain; charset=utf-8")


def _is_finished(sessions: Any, job_id: str) -> bool:
    with sessions() as session:
        phase = session.scalar(select(Job.phase).where(Job.id == job_id))
        return phase is None or phase in TERMINAL_PHASES

