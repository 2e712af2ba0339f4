"""Operational endpoints: /healthz (the process serves), /readyz (the database answers) and /metrics
(Prometheus text: jobs by phase, request latency, and per unfinished job: goodput, lost seconds by
cause, MFU, tokens/s and ETA, labelled by job id and project only).

Mounted by `create_app`. Metrics live in a registry owned by the app (no process-global
collectors), so several apps in one process, as in tests, do not collide.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepfleet.controller.db.jobs import job_performance, jobs_by_phase, live_jobs
from deepfleet.controller.goodput import CAUSES

# Per-job series are kept for at most this many unfinished jobs (the newest): label sets stay bounded
# however many jobs the database holds, and a finished job's series disappear with it.
MAX_JOB_SERIES = 200

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness")
async def healthz() -> dict[str, str]:  # on the event loop: answers while the thread pool is saturated
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: the database answers", responses={503: {"description": "Database down."}})
def readyz(request: Request) -> JSONResponse:
    try:
        with request.app.state.sessions() as session:
            session.execute(text("SELECT 1"))
    except SQLAlchemyError as e:
        return JSONResponse({"status": "unavailable", "detail": type(e).__name__}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}})
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


class _JobsByPhase(Collector):
    """Counts jobs per phase from the database at scrape time."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("deepfleet_jobs", "Jobs by phase.", labels=["phase"])
        try:
            with self.sessions() as session:
                counts = jobs_by_phase(session)
        except SQLAlchemyError:
            counts = {}  # the database is down; /readyz says so, the scrape still succeeds
        for phase, n in counts.items():
            family.add_metric([phase], n)
        yield family


class _JobGauges(Collector):
    """Per-job gauges of the newest MAX_JOB_SERIES unfinished jobs, computed at scrape time."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["job", "project"]
        good = GaugeMetricFamily("deepfleet_job_goodput_ratio", "Productive training time / wall time since submit.",
                                 labels=labels)
        lost = GaugeMetricFamily("deepfleet_job_lost_seconds", "Seconds lost since submit, by cause.",
                                 labels=[*labels, "cause"])
        mfu = GaugeMetricFamily("deepfleet_job_mfu_ratio", "Model FLOPs utilization (newest heartbeat).", labels=labels)
        tps = GaugeMetricFamily("deepfleet_job_tokens_per_second", "Training throughput (newest heartbeat).",
                                labels=labels)
        eta = GaugeMetricFamily("deepfleet_job_eta_seconds", "Seconds to spec.maxSteps at the current step rate.",
                                labels=labels)
        try:
            with self.sessions() as session:
                rows = [(job, job_performance(session, job)) for job in live_jobs(session, limit=MAX_JOB_SERIES)]
        except SQLAlchemyError:
            rows = []  # the database is down (or not migrated yet); the scrape still succeeds
        for job, perf in rows:
            key = [job.id, job.project]
            if perf.goodput.goodput is not None:
                good.add_metric(key, perf.goodput.goodput)
            for cause in CAUSES:
                lost.add_metric([*key, cause], perf.goodput.lost_s.get(cause, 0.0))
            for family, value in ((mfu, perf.mfu), (tps, perf.tokens_per_s), (eta, perf.eta_s)):
                if value is not None:
                    family.add_metric(key, value)
        yield from (good, lost, mfu, tps, eta)


class ApiMetrics:
    """The app's Prometheus registry: request latency by route template, and jobs by phase."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.latency = Histogram(
            "deepfleet_http_request_duration_seconds", "API request latency.",
            ["method", "route", "status"], registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
        )
        self.registry.register(_JobsByPhase(sessions))
        self.registry.register(_JobGauges(sessions))


class TimingMiddleware:
    """Pure ASGI middleware recording each request's latency under its route template (not raw path,
    which would explode label cardinality with job ids)."""

    def __init__(self, app: ASGIApp, *, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route: Any = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.latency.labels(scope["method"], template, str(status["code"])).observe(
                time.perf_counter() - start)


class BodyLimitMiddleware:
    """Answer 413 to bodies over `max_bytes`: at once from Content-Length, or while reading a chunked
    body (buffered up to the limit, then replayed to the app)."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _bad_length(self, send: Send) -> None:
        body = b'{"detail":"invalid Content-Length header","errors":["(headers).content-length: not a number"]}'
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _too_large(self, send: Send) -> None:
        body = (b'{"detail":"request body too large","errors":["(body): larger than %d bytes; '
                b'send a smaller document (inline large engine configs by path instead)"]}' % self.max_bytes)
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await self._bad_length(send)
                return
            if int(length) > self.max_bytes:
                await self._too_large(send)
                return
            await self.app(scope, receive, send)
            return
        if headers.get(b"transfer-encoding", b"").lower() != b"chunked":
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(send)
                return
            more = message.get("more_body", False)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay_receive() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)
