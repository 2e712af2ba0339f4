"""Request dependencies: the database session, the caller (bearer token -> project + role), and the
error type every router raises.

Used by every router in `controller/api`. Authorization rules live here in one place:
- an API token (`dft_...`) is bound to one project and a role: admin > member > viewer;
- a job token (`dfj_...`) is accepted only by the worker endpoints of its own job;
- unknown, malformed, revoked or expired tokens get 401; a role too weak for the call gets 403;
- another project's job is answered exactly like a missing one (404), so ids do not leak.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from deepfleet.controller.db.auth import find_api_token
from deepfleet.controller.db.jobs import get_job
from deepfleet.controller.db.models import Job
from deepfleet.controller.db.outage import is_connection_error
from deepfleet.controller.settings import Settings

ROLE_RANK = {"viewer": 0, "member": 1, "admin": 2}

bearer = HTTPBearer(auto_error=False, description="`Authorization: Bearer dft_<id>_<secret>` (an API token).")


class ApiError(HTTPException):
    """An error answered as `{"detail": ..., "errors": [...]}`; `errors` are "<field.path>: <problem>; <fix>"."""

    def __init__(self, status_code: int, detail: str, *, errors: list[str] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code=status_code, detail=detail, headers=headers)
        self.errors = errors or []


def unauthorized(detail: str = "missing, invalid or expired token; pass Authorization: Bearer <token>") -> ApiError:
    return ApiError(401, detail, headers={"WWW-Authenticate": "Bearer"})


def job_not_found(job_id: str) -> ApiError:
    return ApiError(404, f"job {job_id} not found")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    """The request's session. It is closed after the response has been sent, so a database that goes away
    in between (the close rolls back on a dead connection) is reported as an outage, never raised: raising
    there would cut the client's connection after its complete answer."""
    session = request.app.state.sessions()
    try:
        yield session
    except BaseException:
        _close(request, session)
        raise
    if _close(request, session):
        request.app.state.outage.recovered()  # reached only when the request's database work succeeded


def _close(request: Request, session: Session) -> bool:
    try:
        session.close()
    except Exception as exc:
        if not is_connection_error(exc):
            raise
        request.app.state.outage.failed(exc)
        return False
    return True


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


@dataclass(frozen=True)
class Principal:
    """Who is calling: a token bound to a project and a role."""

    token_id: str
    project: str
    role: str

    @property
    def actor(self) -> str:
        """How events name this caller."""
        return f"token:{self.token_id}"

    def at_least(self, role: str) -> bool:
        return ROLE_RANK[self.role] >= ROLE_RANK[role]


def current_principal(session: SessionDep, credentials: Credentials) -> Principal:
    if credentials is None:
        raise unauthorized()
    row = find_api_token(session, credentials.credentials)
    if row is None:
        raise unauthorized()
    return Principal(token_id=row.id, project=row.project, role=row.role)


PrincipalDep = Annotated[Principal, Depends(current_principal)]


def require(principal: Principal, role: str, action: str) -> None:
    """403 unless the caller's role is at least `role`."""
    if not principal.at_least(role):
        raise ApiError(403, f"role {principal.role} cannot {action}; use a token with role {role} or admin")


def project_job(session: Session, principal: Principal, job_id: str) -> Job:
    """The caller's job, or 404 (also for another project's job)."""
    job = get_job(session, job_id, project=principal.project)
    if job is None:
        raise job_not_found(job_id)
    return job
