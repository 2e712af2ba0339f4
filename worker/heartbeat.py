"""Post heartbeats (and failure reports) to the controller without ever slowing training.

Caller: `worker/train.py` on rank 0 (heartbeats) and on any rank before an abnormal exit (a failure
report). `submit()` only appends to a bounded deque and returns; a daemon thread posts the newest
items with a short HTTP timeout. When the endpoint is slow or down the deque drops its *oldest*
entry (the newest state is what the controller wants), failures are logged at most once per
interval, and nothing ever raises into the training loop. Hand-written on urllib (stdlib) because
the worker image must not need the controller's HTTP client, and no library offers a lossy,
non-blocking reporter with these semantics.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from deepfleet.worker.spec import FailureReport, Heartbeat, HeartbeatSpec

log = logging.getLogger(__name__)


def post_json(url: str, body: bytes, *, token: str | None, timeout_s: float) -> int:
    """POST a JSON body with a bearer token; return the HTTP status. Raises OSError/URLError on failure."""
    request = urllib.request.Request(url, data=body, method="POST")
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 (http(s) checked by the spec)
        return response.status


class HeartbeatReporter:
    """A lossy, non-blocking heartbeat sender: `due()` says when the next beat is wanted, `submit()`
    queues one, a background thread posts them."""

    def __init__(
        self,
        spec: HeartbeatSpec,
        *,
        max_queue: int = 8,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self._clock = clock
        self._queue: collections.deque[bytes] = collections.deque(maxlen=max_queue)
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self._thread: threading.Thread | None = None
        self._next_due = float("-inf")
        self._last_error_log = float("-inf")
        self.sent = 0
        self.failed = 0
        self.dropped = 0

    @property
    def enabled(self) -> bool:
        return self.spec.url is not None

    def due(self) -> bool:
        """True when `interval_s` has passed since the last submitted heartbeat (always False if disabled)."""
        return self.enabled and self._clock() >= self._next_due

    def start(self) -> HeartbeatReporter:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="deepfleet-heartbeat", daemon=True)
            self._thread.start()
        return self

    def submit(self, heartbeat: Heartbeat) -> None:
        """Queue one heartbeat; never blocks. A full queue drops its oldest entry."""
        if not self.enabled:
            return
        self._next_due = self._clock() + self.spec.interval_s
        body = heartbeat.model_dump_json().encode()
        with self._cond:
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
            self._queue.append(body)
            self._cond.notify()

    def report_failure(self, report: FailureReport) -> bool:
        """Post a failure report now (the process is about to exit), bounded by the HTTP timeout.
        Returns whether it was delivered; never raises."""
        if self.spec.failure_url is None:
            return False
        try:
            post_json(self.spec.failure_url, report.model_dump_json().encode(), token=self.spec.token,
                      timeout_s=self.spec.timeout_s)
            return True
        except (OSError, ValueError) as e:  # best effort: the exit code still tells the controller
            log.warning("failure report to %s not delivered: %s", self.spec.failure_url, e)
            return False

    def close(self, *, flush_s: float = 2.0) -> None:
        """Give queued heartbeats up to `flush_s` seconds to go out, then stop the thread."""
        if self._thread is None:
            return
        deadline = time.monotonic() + flush_s
        with self._cond:
            while (self._queue or self._busy) and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, min(0.05, deadline - time.monotonic())))
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=max(0.1, deadline - time.monotonic()))
        self._thread = None

    def _run(self) -> None:
        assert self.spec.url is not None
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                body = self._queue.popleft()
                self._busy = True
            try:
                post_json(self.spec.url, body, token=self.spec.token, timeout_s=self.spec.timeout_s)
                self.sent += 1
            except Exception as e:  # best-effort loop: a heartbeat must never take training down
                self.failed += 1
                now = self._clock()
                if now - self._last_error_log >= self.spec.interval_s:
                    self._last_error_log = now
                    log.warning("heartbeat to %s failed (%d so far): %s", self.spec.url, self.failed, e)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
