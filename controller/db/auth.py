"""API tokens in the database: create, look up a presented token, ensure the bootstrap admin token.

Called by the API's auth dependency and token endpoint, and by `create_app` at start for the
bootstrap token from settings. Formats and hashing live in `controller.tokens`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, select
from sqlalchemy.orm import Session

from deepfleet.controller.db.jobs import ensure_project
from deepfleet.controller.db.models import ApiToken, utcnow
from deepfleet.controller.tokens import hash_secret, mint_api_token, secret_matches, split_api_token


def create_api_token(
    session: Session, *, project: str, role: str, name: str,
    expires_at: datetime | None, created_by: str | None,
) -> tuple[ApiToken, str]:
    """A new token row and the token text (shown once; only its hash is stored)."""
    ensure_project(session, project)
    minted = mint_api_token()
    row = ApiToken(id=minted.id, name=name, project=project, role=role, secret_hash=minted.secret_hash,
                   created_by=created_by, expires_at=expires_at, created_at=utcnow())
    session.add(row)
    session.flush()
    return row, minted.token


_TOKEN_COLUMNS = (ApiToken.id, ApiToken.project, ApiToken.role, ApiToken.secret_hash, ApiToken.expires_at,
                  ApiToken.revoked_at)


def find_api_token(db: Session | Connection, token: str, *, now: datetime | None = None) -> Row[Any] | None:
    """The live token's row (id, project, role, secret_hash, expires_at, revoked_at) for a presented bearer
    token; None when unknown, wrong, revoked or expired. `db` is a session or a plain connection: the
    columns are read as one row, not as a mapped object (this runs on every request's cache miss)."""
    parts = split_api_token(token)
    if parts is None:
        return None
    token_id, secret = parts
    row = db.execute(select(*_TOKEN_COLUMNS).where(ApiToken.id == token_id)).one_or_none()
    if row is None or not secret_matches(secret, row.secret_hash) or row.revoked_at is not None:
        return None
    if row.expires_at is not None and row.expires_at <= (now or utcnow()):
        return None
    return row


def ensure_bootstrap_token(session: Session, token: str, *, project: str) -> ApiToken:
    """Make `token` (from settings) a valid admin token of `project`; idempotent. Raises ValueError.

    A bootstrap token revoked through the API stays revoked across restarts: replace it in settings."""
    parts = split_api_token(token)
    if parts is None:
        raise ValueError("DEEPFLEET_ADMIN_TOKEN: not a deepfleet token; use dft_<12 hex>_<secret of 20+ chars>")
    token_id, secret = parts
    ensure_project(session, project)
    row = session.get(ApiToken, token_id)
    if row is None:
        row = ApiToken(id=token_id, name="bootstrap admin", project=project, role="admin",
                       secret_hash=hash_secret(secret), created_by="settings", created_at=utcnow())
        session.add(row)
    elif row.revoked_at is None:
        row.secret_hash, row.project, row.role, row.expires_at = hash_secret(secret), project, "admin", None
    session.flush()
    return row
