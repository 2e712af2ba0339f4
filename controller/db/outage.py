"""Whether the database is known to be down, shared by the API and the reconcilers of one controller
process, so an outage is logged once (and its end once), not once per request or per pass.

Created by `controller.api.load.install_outage_handler` (as `app.state.outage`); the API's 503 handler
and the reconcilers' loop (`controller.reconciler.Reconciler.run`, wired by `controller.server`) report
into it. `is_connection_error` tells an unreachable database from a real bug, which is logged as one.

A database that is going down or coming up answers some requests and refuses others for a moment (a
fast shutdown ends its sessions one by one). So the outage ends only once the database has answered for
`settle_s` without a failure in between: a flapping database is one outage, logged once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

log = logging.getLogger("deepfleet.controller.db")


def is_connection_error(exc: BaseException) -> bool:
    """True for a lost or refused connection (and an exhausted pool), False for anything else."""
    if isinstance(exc, PoolTimeout | OperationalError):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


class Outage:
    """One warning when the database stops answering, one line when it is back (and stays back)."""

    def __init__(self, *, settle_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.since: float | None = None  # when the outage began; None while the database answers
        self.settle_s = settle_s
        self._answering_since: float | None = None  # the first success since the last failure, mid-outage
        self._clock = clock
        self._lock = threading.Lock()

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self._answering_since = None
            if self.since is not None:
                return
            self.since = self._clock()
        log.warning("database unavailable (%s); answering 503 and pausing reconciling until it is back",
                    type(exc).__name__)

    def recovered(self) -> None:
        if self.since is None:  # the common case, without the lock
            return
        with self._lock:
            if self.since is None:
                return
            now = self._clock()
            if self._answering_since is None:
                self._answering_since = now
            if now - self._answering_since < self.settle_s:
                return  # answering, but not yet for long enough to call the outage over
            since, self.since, self._answering_since = self.since, None, None
        log.warning("database reachable again after %.1f s", now - since)
