"""/v1/queues: the admission queues and their quotas (max processes, max GPUs).

Mounted by `create_app`. Anyone with a token may read the queues (a submitter picks one); queues are
shared by every project, so only admins of the operator project (`settings.admin_project`, the
project of the bootstrap admin token) may create or change them. The scheduler reads the quotas at
its next pass; nothing here touches running jobs.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Path
from sqlalchemy import select

from deepfleet.controller.api.deps import ApiError, PrincipalDep, SessionDep, SettingsDep, require
from deepfleet.controller.api.schemas import ErrorBody, QueueOut, QueueQuota
from deepfleet.controller.db.models import Queue, utcnow

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/queues", tags=["queues"])

QueueName = Annotated[str, Path(max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]


def _out(row: Queue) -> QueueOut:
    return QueueOut(name=row.name, max_processes=row.max_processes, max_gpus=row.max_gpus)


@router.get("", response_model=list[QueueOut], responses={401: {"model": ErrorBody}}, summary="List queues")
def list_queues(principal: PrincipalDep, session: SessionDep) -> list[QueueOut]:
    del principal  # any valid token may read the queues
    return [_out(q) for q in session.scalars(select(Queue).order_by(Queue.name))]


@router.put("/{name}", response_model=QueueOut, responses={401: {"model": ErrorBody}, 403: {"model": ErrorBody}},
            summary="Create a queue or set its quotas")
def put_queue(name: QueueName, quota: QueueQuota, principal: PrincipalDep, session: SessionDep,
              settings: SettingsDep) -> QueueOut:
    require(principal, "admin", "change queues")
    if principal.project != settings.admin_project:
        raise ApiError(403, f"queues are shared by all projects; only admins of project {settings.admin_project!r} "
                            "may change them")
    row = session.get(Queue, name)
    if row is None:
        row = Queue(name=name, created_at=utcnow())
        session.add(row)
    row.max_processes, row.max_gpus = quota.max_processes, quota.max_gpus
    session.commit()
    log.info("queue %s set to max_processes=%s max_gpus=%s by %s", name, quota.max_processes, quota.max_gpus,
             principal.actor)
    return _out(row)
