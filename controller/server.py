"""The controller process: the REST API, the web page and one reconciler per backend, in one process.

Run by `deepfleet server` (which execs `python -m deepfleet.controller.server` so the CLI itself never
imports the API, the database or a backend), by the demo and by end-to-end tests. This is the
composition root: settings -> the backends -> `create_app` (with a log reader over those backends)
-> the web router -> one backend, its model registry and one `Reconciler`
thread per enabled backend (`DEEPFLEET_BACKENDS`: local, kubernetes, azureml), started after the app's
start-up (migrations, bootstrap token) and stopped before its shutdown -> uvicorn on host:port.

On a laptop no token is configured: the server mints an admin token once, keeps it in
`<data_dir>/admin-token` (mode 0600) and reuses it on restart; the CLI finds it there. The key of
the job tokens is kept beside it (`<data_dir>/secret`) unless DEEPFLEET_SECRET sets it.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from pydantic import SecretStr

from deepfleet.controller.api import web
from deepfleet.controller.api.load import ApiProcesses, exit_with_parent, serve, with_api_processes
from deepfleet.controller.api.logs import LogReader, LogUnavailable
from deepfleet.controller.app import create_app
from deepfleet.controller.backends.base import Backend, BackendError
from deepfleet.controller.backends.local import LocalBackend
from deepfleet.controller.confine import closed_ancestor
from deepfleet.controller.db import secrets as secret_store
from deepfleet.controller.reconciler import Reconciler, ReconcilerConfig
from deepfleet.controller.registry import MlflowRegistry, ModelRegistry
from deepfleet.controller.scheduler import UNLIMITED, Limit
from deepfleet.controller.settings import Settings, SettingsError
from deepfleet.controller.tokens import mint_api_token

log = logging.getLogger("deepfleet.controller")
ADMIN_TOKEN_FILE = "admin-token"


SECRET_FILE = "secret"


def persisted(data_dir: Path, *, name: str, make: Callable[[], str]) -> str:
    """A value kept in `<data_dir>/<name>` (mode 0600), made on first use and reused after a restart."""
    path = data_dir / name
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    value = make()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


def backends(settings: Settings, *, slots: int, workdir: Path | None = None,
             worker_command: list[str] | None = None) -> list[tuple[Backend, Limit]]:
    """Each enabled backend with the capacity admission may fill (a cluster's own scheduler bounds the rest)."""
    out: list[tuple[Backend, Limit]] = []
    for name in settings.backends:
        if name == "local":
            local = LocalBackend(settings.logs_root, slots=slots, workdir=workdir, worker_command=worker_command,
                                 jobs_dir=settings.jobs_root, run_as=settings.run_as,
                                 project_users=settings.project_users,
                                 env_passthrough=tuple(settings.local_env_passthrough),
                                 factory_modules=tuple(settings.factory_modules))
            out.append((local, Limit(processes=slots)))
        elif name == "kubernetes":
            from deepfleet.controller.backends.kubernetes.backend import KubernetesBackend, connect

            out.append((KubernetesBackend(connect(), namespace=settings.k8s_namespace), UNLIMITED))
        elif name == "azureml":
            from deepfleet.controller.backends.azureml import from_env

            out.append((from_env(os.environ), UNLIMITED))
    return out


def registry_for(backend: Backend, settings: Settings) -> ModelRegistry | None:
    """Where the models of `backend`'s succeeded jobs are registered: the backend's own registry when it has
    one (Azure ML: the workspace's model assets), MLflow for local jobs, none elsewhere."""
    own = getattr(backend, "model_registry", None)
    if own is not None:
        return own()
    if isinstance(backend, LocalBackend):
        return MlflowRegistry(tracking_uri=settings.mlflow_tracking_uri, store_dir=settings.mlflow_store_dir,
                              scratch_dir=settings.data_dir / "registry-scratch")
    return None


def backend_log_reader(by_name: Mapping[str, Backend]) -> LogReader:
    """The API's log seam over the reconcilers' backend objects: `Backend.logs()` of the run's backend,
    with `BackendError` turned into the API's `LogUnavailable` (the API never sees a backend type)."""

    def read(backend: str, run_name: str, *, node: int, tail: int | None, follow: bool) -> Iterator[str]:
        target = by_name.get(backend)
        if target is None:
            raise LogUnavailable(f"run {run_name} ran on backend {backend}, which this controller does not serve; "
                                 f"enable it in DEEPFLEET_BACKENDS to read its logs")
        try:
            yield from target.logs(run_name, node=node, tail=tail, follow=follow)
        except BackendError as e:
            raise LogUnavailable(str(e)) from e

    return read


def build(settings: Settings, *, slots: int, workdir: Path | None = None, worker_command: list[str] | None = None,
          heartbeat_interval_s: float | None = None, reconcile: bool = True, api_only: bool = False) -> FastAPI:
    """The app with the web page and (if `reconcile`) one reconciler thread per backend, bound to its lifespan;
    job logs are then read through those same backend objects. `api_only`: an extra API process
    (`ApiProcesses`) reads logs through backend objects of its own and runs no reconciler."""
    if not reconcile:
        app = create_app(settings)
        app.include_router(web.router)  # the page is part of the served controller, not of the bare API app
        return app
    enabled = backends(settings, slots=slots, workdir=workdir, worker_command=worker_command)
    app = create_app(settings, log_reader=backend_log_reader({b.name: b for b, _ in enabled}))
    app.include_router(web.router)
    if api_only:
        return app
    for backend, _ in enabled:  # local jobs' secret references read the store in the app's database
        if isinstance(backend, LocalBackend):
            backend.secrets = secret_store.resolver(app.state.sessions, key_material=settings.secret.get_secret_value(),
                                                    old=settings.old_secret_values())
    reconcilers = [
        Reconciler(app.state.sessions, backend=backend, config=ReconcilerConfig(
            replica_id=settings.replica_id, controller_url=settings.controller_url,
            secret=settings.secret.get_secret_value(), backend_name=backend.name, capacity=capacity,
            lease_seconds=settings.lease_seconds, heartbeat_interval_s=heartbeat_interval_s,
        ), outage=app.state.outage, registry=registry_for(backend, settings))
        for backend, capacity in enabled
    ]
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[None]:
        async with inner(a):  # migrations and the bootstrap token first
            stop = threading.Event()
            threads = [threading.Thread(target=r.run, args=(stop,), name=f"reconciler-{r.backend.name}", daemon=True,
                                        kwargs={"interval_s": settings.reconcile_interval_s}) for r in reconcilers]
            for thread in threads:
                thread.start()
            try:
                yield
            finally:
                stop.set()
                for thread in threads:
                    thread.join(timeout=30)

    app.router.lifespan_context = lifespan
    app.state.reconcilers = reconcilers
    return app


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepfleet server", description="Run the deepfleet controller.")
    p.add_argument("--db", help="database URL (default sqlite:///<data-dir>/deepfleet.db; postgresql+psycopg://...)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--fd", type=int, help="serve on this inherited, already listening socket (socket activation, "
                   "test harnesses); --host/--port then only name the controller's URL")
    p.add_argument("--data-dir", type=Path)
    p.add_argument("--slots", type=int, default=os.cpu_count() or 2, help="local backend: processes at once")
    p.add_argument("--workdir", type=Path, help="local backend: working directory of worker processes")
    p.add_argument("--heartbeat-interval", type=float, default=None, help="seconds between worker heartbeats")
    p.add_argument("--reconcile-interval", type=float, default=None)
    p.add_argument("--replica-id")
    p.add_argument("--tls-cert", type=Path, help="serve HTTPS with this PEM certificate (chain); needs --tls-key")
    p.add_argument("--tls-key", type=Path, help="the PEM private key of --tls-cert")
    p.add_argument("--worker-command", help="local backend: command that runs one node (default deepfleet-worker)")
    p.add_argument("--api-processes", type=int, help="processes answering the API on one socket (default "
                   "DEEPFLEET_API_PROCESSES or 1; about one per core for a busy controller)")
    p.add_argument("--api-only", action="store_true", help=argparse.SUPPRESS)  # one of those extra processes
    return p


def _listening_socket(host: str, port: int) -> socket.socket:
    """host:port bound and listening, to be shared by the API processes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _extra_process_command(argv: list[str], fd: int) -> list[str]:
    """This server's command line for one extra API process on the inherited socket `fd`."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--fd":
            skip = True
            continue
        if arg.startswith("--fd="):
            continue
        out.append(arg)
    return [sys.executable, "-m", "deepfleet.controller.server", *out, "--api-only", "--fd", str(fd)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        print("deepfleet server: --tls-cert and --tls-key go together; give both (or neither for plain HTTP)",
              file=sys.stderr)
        return 2
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if path is not None and not path.is_file():
            print(f"deepfleet server: {flag}: {path} is not a file; give the PEM file's path", file=sys.stderr)
            return 2
    scheme = "https" if args.tls_cert else "http"
    tls = {"ssl_certfile": str(args.tls_cert), "ssl_keyfile": str(args.tls_key)} if args.tls_cert else {}
    level = os.environ.get("DEEPFLEET_LOG_LEVEL", "INFO").upper()  # set by the Helm chart
    logging.basicConfig(level=getattr(logging, level, logging.INFO), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings.from_env(
            database_url=args.db, data_dir=args.data_dir, replica_id=args.replica_id,
            reconcile_interval_s=args.reconcile_interval, api_processes=args.api_processes,
            controller_url=(os.environ.get("DEEPFLEET_CONTROLLER_URL") or os.environ.get("DEEPFLEET_PUBLIC_URL")
                            or f"{scheme}://{args.host}:{args.port}"),
        )
        if settings.admin_token is None:
            token = persisted(settings.data_dir, name=ADMIN_TOKEN_FILE, make=lambda: mint_api_token().token)
            settings = settings.model_copy(update={"admin_token": SecretStr(token)})
            print(f"admin token: {settings.data_dir / ADMIN_TOKEN_FILE}", file=sys.stderr, flush=True)
        if not os.environ.get("DEEPFLEET_SECRET"):
            # Job tokens must survive a restart: runs started before it keep posting heartbeats.
            secret = persisted(settings.data_dir, name=SECRET_FILE, make=lambda: secrets.token_urlsafe(32))
            settings = settings.model_copy(update={"secret": SecretStr(secret)})
    except SettingsError as e:
        for line in e.errors:
            print(f"deepfleet server: {line}", file=sys.stderr)
        return 2
    if args.api_only:  # the first process migrated the database and ensured the bootstrap token
        settings = settings.model_copy(update={"migrate_on_start": False, "admin_token": None})
        exit_with_parent()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.data_dir, 0o711)  # others (the jobs' users) may reach their areas, never list it
    if "local" in settings.backends and (settings.run_as or settings.project_users):
        closed = closed_ancestor(settings.jobs_root)
        if closed is not None:
            print(f"deepfleet server: DEEPFLEET_JOBS_DIR: {settings.jobs_root} lies under {closed}, which the jobs' "
                  "user cannot enter; set DEEPFLEET_JOBS_DIR to a directory such as /var/lib/deepfleet/jobs",
                  file=sys.stderr)
            return 2

    command = args.worker_command.split() if args.worker_command else None
    try:
        app = build(settings, slots=args.slots, workdir=args.workdir, worker_command=command,
                    heartbeat_interval_s=args.heartbeat_interval, api_only=args.api_only)
    except BackendError as e:  # a backend that cannot be reached or is not configured
        print(f"deepfleet server: {e}", file=sys.stderr)
        return 2
    fd = args.fd
    if settings.api_processes > 1 and not args.api_only:
        if fd is None:
            try:
                fd = _listening_socket(args.host, args.port).detach()
            except OSError as e:
                print(f"deepfleet server: --port: cannot listen on {args.host}:{args.port} ({e.strerror}); "
                      "pick a free port", file=sys.stderr)
                return 2
        with_api_processes(app, ApiProcesses(_extra_process_command(argv, fd), count=settings.api_processes - 1,
                                             fd=fd))
    if not args.api_only:
        print(f"deepfleet controller on {scheme}://{args.host}:{args.port}/ui/ (db {settings.db_url.split('@')[-1]}, "
              f"logs {settings.logs_root}, {settings.api_processes} API process(es))", file=sys.stderr, flush=True)
    serve(app, fd=fd, host=args.host, port=args.port, log_level="warning", **tls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
