"""/v1/tokens: an admin mints and revokes API tokens of its own project.

Mounted by `create_app`. The token text is returned once; the database keeps only its hash.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from fastapi import APIRouter, Request, Response

from deepfleet.controller.api.deps import ApiError, PrincipalDep, SessionDep, SettingsDep, require
from deepfleet.controller.api.schemas import ErrorBody, TokenCreate, TokenCreated
from deepfleet.controller.db.auth import create_api_token
from deepfleet.controller.db.models import ApiToken, utcnow

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


@router.post("", status_code=201, response_model=TokenCreated,
             responses={401: {"model": ErrorBody}, 403: {"model": ErrorBody}}, summary="Create an API token")
def create_token(body: TokenCreate, principal: PrincipalDep, session: SessionDep, settings: SettingsDep) -> TokenCreated:
    require(principal, "admin", "create tokens")
    project = body.project or principal.project
    if project != principal.project:
        raise ApiError(403, "token project mismatch", errors=[
            f"project: an admin of {principal.project!r} can only create tokens for {principal.project!r}; "
            "drop project or use an admin token of that project"])
    days = body.expires_in_days if body.expires_in_days is not None else settings.token_ttl_days
    expires_at = utcnow() + timedelta(days=days) if days is not None else None
    row, token = create_api_token(session, project=project, role=body.role, name=body.name,
                                  expires_at=expires_at, created_by=principal.actor)
    session.commit()
    # Tokens are not job state, so this audit line goes to the server log rather than a job's events.
    log.info("token %s (%s, role %s) created by %s", row.id, project, row.role, principal.actor)
    return TokenCreated(id=row.id, name=row.name, project=row.project, role=row.role,
                        expires_at=row.expires_at, token=token)


@router.delete("/{token_id}", status_code=204, responses={401: {"model": ErrorBody}, 403: {"model": ErrorBody},
                                                          404: {"model": ErrorBody}}, summary="Revoke an API token")
def revoke_token(token_id: str, request: Request, principal: PrincipalDep, session: SessionDep) -> Response:
    require(principal, "admin", "revoke tokens")
    row = session.get(ApiToken, token_id)
    if row is None or row.project != principal.project:
        raise ApiError(404, f"token {token_id} not found")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.commit()
        log.info("token %s (%s) revoked by %s", row.id, row.project, principal.actor)
    # At once in this process; the other API processes stop trusting it within settings.token_cache_s.
    request.app.state.principals.forget(token_id)
    return Response(status_code=204)
