"""Bearer-token formats: API tokens (stored hashed) and job-scoped worker tokens (HMAC, never stored).

Called by the API's auth dependency, by the token-creating endpoint, and by `controller.compile`
when it hands a worker its token. Stdlib only (`secrets`, `hashlib`, `hmac`): FastAPI's security
helpers only extract the header; minting and checking is ours.

- API token: `dft_<id>_<secret>`. `<id>` (12 hex chars) is the row's primary key, so a lookup is one
  indexed read; only sha256(secret) is stored, compared in constant time.
- Job token: `dfj_` + HMAC-SHA256(controller secret, "job:<job id>") hex[:40]. It authorizes worker
  calls (heartbeat, failure report) for that one job, and needs no table.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

API_PREFIX = "dft_"
JOB_PREFIX = "dfj_"
_API_TOKEN = re.compile(r"^dft_([0-9a-f]{12})_([A-Za-z0-9_-]{20,})$")


@dataclass(frozen=True)
class MintedToken:
    """A new API token: `token` is shown to the user once; `id` and `secret_hash` are stored."""

    id: str
    token: str
    secret_hash: str


def hash_secret(secret: str) -> str:
    """sha256 hex of a token secret (random secrets need no slow KDF)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def mint_api_token() -> MintedToken:
    """A fresh random API token."""
    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return MintedToken(id=token_id, token=f"{API_PREFIX}{token_id}_{secret}", secret_hash=hash_secret(secret))


def split_api_token(token: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed API token, else None."""
    match = _API_TOKEN.match(token)
    return (match.group(1), match.group(2)) if match else None


def secret_matches(secret: str, secret_hash: str) -> bool:
    """Constant-time check of a presented secret against its stored hash."""
    return hmac.compare_digest(hash_secret(secret), secret_hash)


def job_token(secret: str, job_id: str) -> str:
    """The bearer token that authorizes worker calls for `job_id` only."""
    digest = hmac.new(secret.encode(), f"job:{job_id}".encode(), hashlib.sha256).hexdigest()
    return JOB_PREFIX + digest[:40]


def verify_job_token(secret: str, job_id: str, token: str, *, old_secrets: Sequence[str] = ()) -> bool:
    """True when `token` is `job_id`'s job token under `secret` or one of `old_secrets` (a rotation keeps
    the jobs started before it working until they end); constant-time comparisons."""
    return any([hmac.compare_digest(job_token(key, job_id), token) for key in (secret, *old_secrets)])
