"""Worker endpoints: heartbeats and failure reports posted by a job's own processes.

Mounted by `create_app`. A worker authenticates with its job token (`DEEPFLEET_TOKEN`, valid for
that one job, see `controller.tokens`); a member or admin API token of the job's project also works
(for tools replaying metrics). A job token expires when its job reaches a terminal phase. The answer tells the worker whether the job should keep running.
"""

from __future__ import annotations

from fastapi import APIRouter

from deepfleet.controller.api.deps import (
    ApiError,
    Credentials,
    SessionDep,
    SettingsDep,
    job_not_found,
    unauthorized,
)
from deepfleet.controller.api.schemas import ErrorBody, HeartbeatAck
from deepfleet.controller.db import jobs as store
from deepfleet.controller.db.auth import find_api_token
from deepfleet.controller.db.models import TERMINAL_PHASES, Job
from deepfleet.controller.tokens import JOB_PREFIX, verify_job_token
from deepfleet.worker.spec import FailureReport, Heartbeat

router = APIRouter(prefix="/v1/jobs", tags=["workers"])

ERRORS = {
    401: {"model": ErrorBody, "description": "Missing or invalid token."},
    404: {"model": ErrorBody, "description": "No such job for this token."},
}


def _worker_job(session: SessionDep, settings: SettingsDep, credentials: Credentials, job_id: str) -> Job:
    if credentials is None:
        raise unauthorized()
    token = credentials.credentials
    if token.startswith(JOB_PREFIX):
        if not verify_job_token(settings.secret.get_secret_value(), job_id, token,
                                old_secrets=settings.old_secret_values()):
            raise unauthorized("this job token is not valid for this job; use the DEEPFLEET_TOKEN given to it")
        job = session.get(Job, job_id)
        if job is not None and job.phase in TERMINAL_PHASES:
            raise unauthorized(f"job {job_id} has finished ({job.phase}); its job token has expired")
    else:
        row = find_api_token(session, token)
        if row is None:
            raise unauthorized()
        if row.role not in ("member", "admin"):
            raise ApiError(403, f"role {row.role} cannot post worker reports; use the job's token")
        job = store.get_job(session, job_id, project=row.project)
    if job is None:
        raise job_not_found(job_id)
    return job


@router.post("/{job_id}/heartbeat", response_model=HeartbeatAck, responses={**ERRORS, 403: {"model": ErrorBody}},
             summary="Post a training heartbeat (rank 0)")
def post_heartbeat(job_id: str, heartbeat: Heartbeat, session: SessionDep, settings: SettingsDep,
                   credentials: Credentials) -> HeartbeatAck:
    job = _worker_job(session, settings, credentials, job_id)
    store.record_heartbeat(session, job, heartbeat)
    session.commit()
    return HeartbeatAck(desired_state=job.desired_state)


@router.post("/{job_id}/failure", status_code=202, response_model=HeartbeatAck,
             responses={**ERRORS, 403: {"model": ErrorBody}}, summary="Post a failure report (any rank)")
def post_failure(job_id: str, report: FailureReport, session: SessionDep, settings: SettingsDep,
                 credentials: Credentials) -> HeartbeatAck:
    job = _worker_job(session, settings, credentials, job_id)
    store.record_failure_report(session, job, report)
    session.commit()
    return HeartbeatAck(desired_state=job.desired_state)
