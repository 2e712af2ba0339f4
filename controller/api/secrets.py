"""/v1/secrets: the local backend's secret store of the caller's project (`controller.db.secrets`).

Mounted by `create_app`. An admin sets and deletes values; members list names. No answer, event or
log line carries a value: a PUT answers with the name and times only, and a validation error of the
body names the field, never its content. Jobs reference a secret as `env: {VAR: {secret: <name>}}`.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Response
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from deepfleet.controller.api.deps import ApiError, PrincipalDep, SessionDep, SettingsDep, require
from deepfleet.controller.api.schemas import ErrorBody
from deepfleet.controller.db import secrets as store

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/secrets", tags=["secrets"])
SecretName = Annotated[str, Path(max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                 description="A DNS-1123 label: lowercase letters, digits and '-'.")]
ERRORS = {401: {"model": ErrorBody}, 403: {"model": ErrorBody}}


class SecretValue(BaseModel):
    """The value to store (write-only: never returned)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    value: SecretStr = Field(min_length=1, max_length=store.MAX_VALUE_BYTES)
    """The secret text (at most 64 KiB)."""


class SecretInfo(BaseModel):
    """A stored secret, without its value."""

    name: str
    created_at: datetime
    updated_at: datetime
    updated_by: str | None


class SecretList(BaseModel):
    items: list[SecretInfo]


def _info(row) -> SecretInfo:  # noqa: ANN001 - a StoredSecret row
    return SecretInfo(name=row.name, created_at=row.created_at, updated_at=row.updated_at, updated_by=row.updated_by)


@router.get("", response_model=SecretList, responses=ERRORS, summary="List the project's secret names")
def list_secrets(principal: PrincipalDep, session: SessionDep) -> SecretList:
    require(principal, "member", "list secrets")
    return SecretList(items=[_info(r) for r in store.names(session, project=principal.project)])


@router.put("/{name}", response_model=SecretInfo, summary="Set a secret",
            responses={**ERRORS, 201: {"model": SecretInfo, "description": "Created (200: replaced)"}})
def put_secret(name: SecretName, body: SecretValue, principal: PrincipalDep, session: SessionDep,
               settings: SettingsDep, response: Response) -> SecretInfo:
    require(principal, "admin", "set secrets")
    created = store.put(session, project=principal.project, name=name, value=body.value.get_secret_value(),
                        key_material=settings.secret.get_secret_value(), actor=principal.actor)
    session.commit()
    log.info("secret %s/%s %s by %s", principal.project, name, "created" if created else "replaced", principal.actor)
    response.status_code = 201 if created else 200
    return _info(session.get(store.StoredSecret, (principal.project, name)))


@router.delete("/{name}", status_code=204, responses={**ERRORS, 404: {"model": ErrorBody}}, summary="Delete a secret")
def delete_secret(name: SecretName, principal: PrincipalDep, session: SessionDep) -> Response:
    require(principal, "admin", "delete secrets")
    if not store.delete(session, project=principal.project, name=name):
        raise ApiError(404, f"secret {name} not found in project {principal.project}")
    session.commit()
    log.info("secret %s/%s deleted by %s", principal.project, name, principal.actor)
    return Response(status_code=204)
