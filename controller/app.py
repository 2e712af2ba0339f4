"""`create_app(settings)`: the controller's FastAPI application (REST API under /v1, health, metrics).

Called by `deepfleet server` (with uvicorn), by the demo and by tests; there is no module-level app.
At start (lifespan) it migrates the database when `settings.migrate_on_start` is set and ensures the
bootstrap admin token. Errors are answered as `{"detail": ..., "errors": ["<field.path>: ...; fix"]}`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from deepfleet.controller.api import health, jobs, queues, secrets, tokens, workers
from deepfleet.controller.api.deps import ApiError
from deepfleet.controller.api.headers import SecurityHeaders
from deepfleet.controller.api.load import RequestGate, install_outage_handler, per_process_limit
from deepfleet.controller.api.logs import LogLocator, LogReader, file_log_locator
from deepfleet.controller.api.principals import TokenCache
from deepfleet.controller.db.auth import ensure_bootstrap_token
from deepfleet.controller.db.session import make_engine, make_session_factory
from deepfleet.controller.policy import Policies
from deepfleet.controller.settings import Settings
from deepfleet.controller.spec import JobSpec, ServingJob

API_TITLE = "deepfleet controller"
API_VERSION = "0.1.0"


def _field_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc) or "(request)"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail, "errors": exc.errors}, status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"detail": exc.detail, "errors": []}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_left(_: Request, exc: ClientDisconnect) -> Response:
        # The client closed its connection before its whole request arrived: nobody is left to answer
        # and nothing went wrong here, so no traceback is logged (uvicorn would log one as a 500).
        return Response(status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for err in exc.errors():
            msg = str(err.get("msg", "")).removeprefix("Value error, ")
            fix = "remove it" if err.get("type") == "extra_forbidden" else "fix the value"
            errors.append(f"{_field_path(tuple(err.get('loc', ())))}: {msg}; {fix}")
        return JSONResponse({"detail": "invalid request", "errors": errors}, status_code=422)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document plus the JobSpec schemas the submit endpoint's request body references."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in (JobSpec, ServingJob):
        spec_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, schema in spec_schema.pop("$defs", {}).items():
            assert name not in schemas or schemas[name] == schema, f"schema name clash: {name}"
            schemas[name] = schema
        schemas[spec_schema["title"]] = spec_schema
    app.openapi_schema = doc
    return doc


class _App(FastAPI):
    """FastAPI with the security headers outside even Starlette's error middleware, so a 500 has them too."""

    def build_middleware_stack(self) -> Any:
        return SecurityHeaders(super().build_middleware_stack())


def create_app(settings: Settings, *, log_reader: LogReader | None = None, log_locator: LogLocator | None = None,
               log_poll_s: float = 0.5) -> FastAPI:
    """The controller API bound to `settings` (database, limits, tokens).

    `log_reader` serves job logs from the backends (`Backend.logs()`, wired by `controller/server.py`);
    without one, logs are read from files: `log_locator` maps (run name, node) to a log file, by default
    `<logs_dir>/<run name>/node-<i>.log`.
    """
    # One connection per request in flight, plus room for the reconcilers and the metrics collector.
    limit = per_process_limit(settings.max_inflight_requests, settings.api_processes)
    engine = make_engine(settings.db_url, pool_size=limit, max_overflow=16 if settings.api_processes == 1 else 8)
    sessions = make_session_factory(engine)

    @asynccontextmanager
    async def lifespan(served: FastAPI) -> AsyncIterator[None]:
        # Threads for every admitted request plus the streaming/log helpers: the pool never starves them.
        anyio.to_thread.current_default_thread_limiter().total_tokens = limit + 8
        # Parsing a job is pure CPU under the GIL: more parsers than cores only starve the event loop
        # (and /healthz with it), so they queue here instead.
        served.state.parse_limiter = anyio.CapacityLimiter(os.cpu_count() or 2)
        # The engine config's models load on the first submit otherwise, inside its request.
        await run_in_threadpool(importlib.import_module, "deepfleet.engine.config")
        if settings.migrate_on_start:
            from deepfleet.controller.db.migrate import upgrade_head

            await run_in_threadpool(upgrade_head, settings.db_url)
        if settings.admin_token is not None:
            token = settings.admin_token.get_secret_value()

            def bootstrap() -> None:
                with sessions() as session:
                    ensure_bootstrap_token(session, token, project=settings.admin_project)
                    session.commit()

            await run_in_threadpool(bootstrap)
        try:
            yield
        finally:
            engine.dispose()

    # No /docs or /redoc: FastAPI's pages load their scripts from a CDN into the origin that holds the
    # page's token; the document itself is served at /openapi.json (docs/controller.md).
    app = _App(
        title=API_TITLE, version=API_VERSION, lifespan=lifespan, docs_url=None, redoc_url=None,
        description="Submit, inspect and cancel deepfleet training jobs. Every call takes "
                    "`Authorization: Bearer <token>`; a token sees only its own project.",
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessions = sessions
    # The read routes' connections (same pool): autocommit, so a read costs no BEGIN/ROLLBACK round trips.
    app.state.read_engine = engine.execution_options(isolation_level="AUTOCOMMIT")
    app.state.principals = TokenCache(settings.token_cache_s)
    app.state.log_reader = log_reader
    app.state.log_locator = log_locator or file_log_locator(settings.logs_root)
    app.state.log_poll_s = log_poll_s
    app.state.metrics = health.ApiMetrics(sessions)
    app.state.policies = Policies.load(settings.policy_file)
    _install_error_handlers(app)
    install_outage_handler(app)
    for module in (jobs, workers, queues, tokens, secrets, health):
        app.include_router(module.router)
    # Order: the body limit runs first (outermost), so oversized requests are timed as 413s too.
    app.add_middleware(health.TimingMiddleware, metrics=app.state.metrics)
    app.add_middleware(health.BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    # Outermost of these: a request waits for a slot before it is read or timed (the security headers
    # wrap even this, see _App).
    app.add_middleware(RequestGate, limit=limit, queue_timeout_s=settings.queue_timeout_s,
                       shed=settings.api_processes > 1)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app
