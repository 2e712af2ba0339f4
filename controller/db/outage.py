"""Whether the database is known to be down, shared by the API and the reconcilers of one controller
process, so an outage is logged once (and its end once), not once per request or per pass.

Created by `controller.api.load.install_outage_handler` (as `app.state.outage`); the API's 503 handler
and the reconcilers' loop (`controller.reconciler.Reconciler.run`, wired by `controller.server`) report
into it. `is_connection_error` tells an unreachable database from a real bug, which is logged as one.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

log = logging.getLogger("deepfleet.controller.db")


def is_connection_error(exc: BaseException) -> bool:
    """True for a lost or refused connection (and an exhausted pool), False for anything else."""
    if isinstance(exc, PoolTimeout | OperationalError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


class Outage:
    """One warning when the database stops answering, one line when it is back."""

    def __init__(self) -> None:
        self.since: float | None = None
        self._lock = threading.Lock()

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            if self.since is not None:
                return
            self.since = time.monotonic()
        log.warning("database unavailable (%s); answering 503 and pausing reconciling until it is back",
                    type(exc).__name__)

    def recovered(self) -> None:
        if self.since is None:  # the common case, without the lock
            return
        with self._lock:
            since, self.since = self.since, None
        if since is not None:
            log.warning("database reachable again after %.1f s", time.monotonic() - since)
