"""Post heartbeats (and failure reports) to the controller without ever slowing training.

Callers: the engine's step seam, through `HeartbeatSink` (a `StepSink`: heartbeats are made from the
engine's `StepMetrics`, never measured here), which `worker/train.py` adds to the managed loop's engine
and `step_sink()` builds for a plain script (the worker's launch environment names it in
`DEEPFLEET_STEP_SINKS`); `worker/agent.py` on any rank before an abnormal exit (a failure report).
`HeartbeatReporter.submit()` only appends to a bounded deque and returns; a daemon thread posts the newest
items with a short HTTP timeout. When the endpoint is slow or down the deque drops its *oldest*
entry (the newest state is what the controller wants), failures are logged at most once per
interval, and nothing ever raises into the training loop. Hand-written on urllib (stdlib) because
the worker image must not need the controller's HTTP client, and no library offers a lossy,
non-blocking reporter with these semantics.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deepfleet.worker.spec import (
    HEARTBEAT_URL_ENV,
    SPEC_ENV,
    TOKEN_ENV,
    FactoryEntrypoint,
    FailureReport,
    Heartbeat,
    HeartbeatSpec,
    load_worker_spec,
)

if TYPE_CHECKING:
    from deepfleet.engine.metrics import StepMetrics

log = logging.getLogger(__name__)


CA_BUNDLE_ENV = "DEEPFLEET_CA_BUNDLE"


def tls_context(environ: Mapping[str, str] | None = None) -> ssl.SSLContext:
    """The context an https post verifies the controller with: the system's trust store, or only the
    PEM CA bundle named by DEEPFLEET_CA_BUNDLE (a private CA or a self-signed controller certificate)."""
    env = os.environ if environ is None else environ
    return ssl.create_default_context(cafile=env.get(CA_BUNDLE_ENV) or None)


def post_json(url: str, body: bytes, *, token: str | None, timeout_s: float) -> int:
    """POST a JSON body with a bearer token; return the HTTP status. Raises OSError/URLError on failure
    (also when an https controller's certificate does not verify: see `tls_context`)."""
    request = urllib.request.Request(url, data=body, method="POST")
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = tls_context() if url.startswith("https://") else None
    with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:  # noqa: S310 (http(s) checked by the spec)
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


class HeartbeatSink:
    """A `StepSink` (see `deepfleet.engine.metrics`) that turns the engine's step records into heartbeats:
    whenever the reporter says one is due, it submits the newest step's loss, lr and grad norm and the
    token throughput over the steps since the previous heartbeat. `last_checkpoint()` names the newest
    complete checkpoint (the managed loop knows it; a script job's is read from its checkpoint dir)."""

    def __init__(self, reporter: HeartbeatReporter, *,
                 last_checkpoint: Callable[[], str | None] = lambda: None) -> None:
        self.reporter = reporter
        self.last_checkpoint = last_checkpoint
        self.last: StepMetrics | None = None
        self._tokens: int | None = None
        self._elapsed = 0.0
        self.checkpoint_s = 0.0  # seconds this process has spent in save_checkpoint (the engine's timings)

    def __call__(self, m: StepMetrics) -> None:
        self.last = m
        self.checkpoint_s += m.timings.get("checkpoint", 0.0)
        if m.tokens is not None:
            self._tokens = (self._tokens or 0) + m.tokens
        self._elapsed += m.elapsed_s
        if self.reporter.due():
            self.beat()

    def heartbeat(self, **fields: Any) -> Heartbeat:
        """A heartbeat of the newest step (fields override: e.g. loss=None after the run)."""
        m = self.last
        values: dict[str, Any] = {"step": 0, "last_complete_checkpoint": self.last_checkpoint(), **_provenance()}
        if m is not None:
            rate = self._tokens / self._elapsed if self._tokens is not None and self._elapsed > 0 else None
            values.update(step=m.step, loss=m.loss, lr=m.lr, grad_norm=_finite(m.grad_norm), tokens_per_s=rate,
                          mfu=_finite(m.mfu), checkpoint_s=self.checkpoint_s, dp_epsilon=_finite(m.dp_epsilon),
                          dp_delta=m.dp_delta, dp_accountant=m.dp_accountant)
        values.update(fields)
        return Heartbeat(**values)

    def beat(self, **fields: Any) -> None:
        """Submit a heartbeat now (never blocks) and start a new throughput window."""
        self.reporter.submit(self.heartbeat(**fields))
        self._tokens, self._elapsed = None, 0.0


def _provenance() -> dict[str, Any]:
    # The engine is loaded in every process that builds a sink: torch's version and the datasets the
    # training code reported ride along in every heartbeat (the controller records what is new).
    import torch

    from deepfleet.engine.provenance import reported

    return {"torch_version": torch.__version__, "datasets": reported()}


def _finite(x: float | None) -> float | None:
    # An fp16-overflowed step has an inf/nan norm; JSON has no such numbers.
    return x if x is None or x - x == 0 else None


def step_sink(environ: Mapping[str, str] | None = None) -> HeartbeatSink | None:
    """The `DEEPFLEET_STEP_SINKS` factory ("deepfleet.worker.heartbeat:step_sink") that gives a plain
    script launched by the worker the managed loop's heartbeats. On rank 0 only (None elsewhere, when
    no heartbeat URL is known, and for a factory job, whose managed loop posts its own). The endpoint comes from the worker spec in `DEEPFLEET_WORKER_SPEC`
    (interval and timeout included), else from `DEEPFLEET_HEARTBEAT_URL`; the token from
    `DEEPFLEET_TOKEN`. Heartbeats name the newest complete checkpoint under the spec's
    `checkpoint.dir`. A last heartbeat goes out, and the queue is flushed, when the script exits."""
    env = os.environ if environ is None else environ
    if _rank(env) != 0:
        return None
    ckpt_dir: str | None = None
    if env.get(SPEC_ENV):
        spec = load_worker_spec(environ=env)
        if isinstance(spec.entrypoint, FactoryEntrypoint):
            return None  # the managed loop (worker/train.py) adds its own HeartbeatSink
        hb, ckpt_dir = spec.heartbeat, (spec.checkpoint.dir if spec.checkpoint else None)
    else:
        hb = HeartbeatSpec(url=env.get(HEARTBEAT_URL_ENV), token=env.get(TOKEN_ENV))
    if hb.url is None:
        return None
    sink = HeartbeatSink(HeartbeatReporter(hb).start(), last_checkpoint=_checkpoint_reader(ckpt_dir))

    def at_exit() -> None:
        if sink.last is not None:
            sink.beat()
        sink.reporter.close()

    atexit.register(at_exit)
    return sink


def _rank(env: Mapping[str, str]) -> int:
    import torch.distributed as dist  # the engine is already loaded: this sink is built by it

    return dist.get_rank() if dist.is_initialized() else int(env.get("RANK", "0"))


def _checkpoint_reader(ckpt_dir: str | None) -> Callable[[], str | None]:
    if ckpt_dir is None:
        return lambda: None
    from deepfleet.engine.checkpoint.layout import find_latest_complete

    root = Path(ckpt_dir)
    return lambda: find_latest_complete(root) if root.is_dir() else None
