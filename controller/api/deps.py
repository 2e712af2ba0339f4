"""Request dependencies: the database session, the caller (bearer token -> project + role), the error
type every router raises, and `read_json`, how the busiest read routes answer.

Used by every router in `controller/api`. Authorization rules live here in one place:
- an API token (`dft_...`) is bound to one project and a role: admin > member > viewer;
- a job token (`dfj_...`) is accepted only by the worker endpoints of its own job;
- unknown, malformed, revoked or expired tokens get 401; a role too weak for the call gets 403; a
  revoked token keeps working for at most `Settings.token_cache_s` in the API processes that had
  verified it (see `controller.api.principals`);
- another project's job is answered exactly like a missing one (404), so ids do not leak.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic_core import to_json
from sqlalchemy import Connection
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from deepfleet.controller.api.principals import Principal
from deepfleet.controller.db.auth import find_api_token
from deepfleet.controller.db.jobs import get_job
from deepfleet.controller.db.models import Job
from deepfleet.controller.db.outage import is_connection_error
from deepfleet.controller.settings import Settings

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


def _look_up(request: Request, token: str) -> Principal | None:
    tokens = request.app.state.principals
    with request.app.state.read_engine.connect() as connection:
        row = find_api_token(connection, token, now=tokens.now())
    return None if row is None else tokens.put(row)


async def current_principal(request: Request, credentials: Credentials) -> Principal:
    """The caller, from the token cache (`controller.api.principals`) or, on a miss, from the database on
    a connection of its own; answered on the event loop when cached."""
    if credentials is None:
        raise unauthorized()
    principal = request.app.state.principals.get(credentials.credentials)
    if principal is None:
        principal = await run_in_threadpool(_look_up, request, credentials.credentials)
        if principal is None:
            raise unauthorized()
    return principal


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


def json_body(fields: Any) -> bytes:
    """JSON of a response model's fields (plain dicts, lists, datetimes, models), byte for byte what FastAPI
    writes for the validated model: compact, datetimes in ISO 8601, non-finite floats as null."""
    return to_json(fields, inf_nan_mode="null")


async def read_json(request: Request, read: Callable[[Connection], Any]) -> Response:
    """Answer a read route with `read(connection)`: the fields of its response model, sent as
    JSON (`json_body`) without building the model. One trip to the thread pool and one pooled connection
    in autocommit mode: no ORM session, no BEGIN/ROLLBACK round trips (each statement reads committed
    data, as it did under READ COMMITTED), and psycopg keeps its prepared statements across requests (a
    rollback drops them)."""
    state = request.app.state

    def run() -> bytes:
        with state.read_engine.connect() as connection:
            return json_body(read(connection))

    body = await run_in_threadpool(run)
    state.outage.recovered()  # reached only when the database answered
    return Response(body, media_type="application/json")
