"""Who is calling: API tokens resolved to a project and a role, with the verified ones remembered for a
few seconds so a busy reader's requests cost no token lookup each.

Used by the auth dependency (`controller.api.deps.current_principal`) and the read routes
(`controller.api.deps.read_json`); `create_app` builds one `TokenCache` per API process from
`Settings.token_cache_s`.

Revocation stays bounded: a token is trusted without a lookup for at most `ttl_s` after the lookup
that verified it, so a token revoked (or expired early) in the database stops working in every API
process within `ttl_s`, and at once in the process that revoked it (`forget`). A token's own expiry is
checked on every request, cached or not. Only sha256 of the secret is kept, as in the table; unknown
or wrong tokens are never remembered (each one is looked up).
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from deepfleet.controller.db.models import utcnow
from deepfleet.controller.tokens import hash_secret, split_api_token

ROLE_RANK = {"viewer": 0, "member": 1, "admin": 2}


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


@dataclass(frozen=True)
class _Verified:
    secret_hash: str
    principal: Principal
    expires_at: datetime | None
    verified_at: float  # the clock's time of the database lookup


class TokenCache:
    """Tokens a database lookup verified, trusted for `ttl_s` seconds after it (0: every request looks up).

    Thread-safe: it is filled from the thread pool and read on the event loop. `clock` (monotonic
    seconds) times the trust, `now` (aware UTC) judges expiry; both injectable for tests. Holds at most `max_entries` tokens (all are dropped when full: live tokens are looked up again)."""

    def __init__(self, ttl_s: float, *, clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime] = utcnow, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.now = now
        """The wall clock expiry is judged by, here and in the lookups on a miss."""
        self._clock = clock
        self._verified: dict[str, _Verified] = {}
        self._lock = threading.Lock()

    def get(self, token: str) -> Principal | None:
        """The principal of `token` if a lookup verified it less than `ttl_s` ago and it has not expired;
        None means: look it up (`resolve`)."""
        parts = split_api_token(token)
        entry = self._verified.get(parts[0]) if parts is not None else None
        if entry is None or self._clock() - entry.verified_at >= self.ttl_s:
            return None
        if not hmac.compare_digest(hash_secret(parts[1]), entry.secret_hash):  # type: ignore[index]
            return None
        if entry.expires_at is not None and entry.expires_at <= self.now():
            return None
        return entry.principal

    def put(self, row: Any) -> Principal:
        """Remember a token row that `find_api_token` returned (verified just now); its principal."""
        principal = Principal(token_id=row.id, project=row.project, role=row.role)
        if self.ttl_s > 0:
            with self._lock:
                if len(self._verified) >= self.max_entries:
                    self._verified.clear()
                self._verified[row.id] = _Verified(row.secret_hash, principal, row.expires_at, self._clock())
        return principal

    def forget(self, token_id: str) -> None:
        """Stop trusting a token at once (this process revoked it)."""
        with self._lock:
            self._verified.pop(token_id, None)
