"""The job commands of the `deepfleet` CLI: server, submit, ls, get, top, logs, cancel, events, token create.

Registered on the root typer app by `controller/cli.py` (`register(app)`). Talks to the controller
only through `controller.client` (HTTP); it never imports the API, the database or a backend
(import-linter checks it), which is why `server` execs `python -m deepfleet.controller.server`.

Where the controller is and which token to use, first match wins: the flags `--url`/`--token`, the
variables `DEEPFLEET_URL`/`DEEPFLEET_API_TOKEN`, `~/.config/deepfleet/config.yaml` (`url:`, `token:`),
then the embedded default `http://127.0.0.1:8000` with the token a local `deepfleet server` minted
in its data dir.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

EXIT_INVALID_INPUT = 2
EXIT_FAILED = 1
DEFAULT_URL = "http://127.0.0.1:8000"
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}

UrlOpt = Annotated[str | None, typer.Option("--url", help="Controller URL (env DEEPFLEET_URL).")]
TokenOpt = Annotated[str | None, typer.Option("--token", help="API token (env DEEPFLEET_API_TOKEN).")]


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "deepfleet" / "config.yaml"


def _data_dir() -> Path:
    if os.environ.get("DEEPFLEET_DATA_DIR"):
        return Path(os.environ["DEEPFLEET_DATA_DIR"])
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "deepfleet"


def resolve(url: str | None, token: str | None) -> tuple[str, str | None]:
    """(url, token) from flags, environment, config file, then the local server's minted token."""
    cfg: dict[str, Any] = {}
    path = config_path()
    if path.exists():
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            _fail(f"{path}: not valid YAML ({str(e).splitlines()[0]}); fix or remove the file")
        if not isinstance(loaded, dict) or set(loaded) - {"url", "token"}:
            _fail(f"{path}: expected a mapping with keys url and token only; fix the file")
        cfg = loaded
    url = url or os.environ.get("DEEPFLEET_URL") or cfg.get("url") or DEFAULT_URL
    token = token or os.environ.get("DEEPFLEET_API_TOKEN") or cfg.get("token")
    if token is None:
        minted = _data_dir() / "admin-token"
        if minted.exists():
            token = minted.read_text().strip()
    return url, token


def _fail(message: str, errors: list[str] | None = None, *, code: int = EXIT_INVALID_INPUT) -> None:
    typer.echo(f"error: {message}", err=True)
    for line in errors or []:
        typer.echo(f"  {line}", err=True)
    raise typer.Exit(code)


def _client(url: str | None, token: str | None):  # noqa: ANN202 - deepfleet.controller.client.Client
    from deepfleet.controller.client import Client

    base, bearer = resolve(url, token)
    return Client(base, token=bearer)


def _call(fn, *args: Any, **kw: Any) -> Any:  # noqa: ANN001 - any client method
    from deepfleet.controller.client import ApiError

    try:
        return fn(*args, **kw)
    except ApiError as e:
        _fail(e.detail, e.errors, code=EXIT_INVALID_INPUT if 400 <= e.status < 500 else EXIT_FAILED)


def load_job_document(path: Path) -> str:
    """The job file, checked locally with the same JobSpec the server uses; a relative `spec.engine`
    path is read here and sent inline, so the server need not see the submitter's files."""
    from deepfleet.controller.spec import SpecError, parse_job_yaml

    if not path.is_file():
        _fail(f"{path}: no such file; pass the path of a job YAML")
    text = path.read_text()
    try:
        spec = parse_job_yaml(text, base_dir=path.parent)
    except SpecError as e:
        _fail(f"{path}: invalid job spec", e.errors)
    doc = spec.to_document()
    engine = spec.spec.engine
    if isinstance(engine, str):
        engine_path = Path(engine).expanduser()
        engine_path = engine_path if engine_path.is_absolute() else path.parent / engine_path
        # The engine's own reader (the one the server and the worker use): `5e8` is the same number here.
        from deepfleet.engine.config_source import read_source

        errors: list[str] = []
        body = read_source(engine_path, errors)
        if body is None:
            _fail(f"{path}: invalid engine config", [f"spec.engine.{line}" for line in errors])
        doc["spec"]["engine"] = body
    return json.dumps(doc)


def register(app: typer.Typer) -> None:
    """Add the job commands to the root app."""

    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def server(
        ctx: typer.Context,
        db: Annotated[str | None, typer.Option("--db", help="sqlite:///path (default) or postgresql+psycopg://...")] = None,
        host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
        slots: Annotated[int | None, typer.Option(help="Local backend: training processes at once.")] = None,
    ) -> None:
        """Run the controller: REST API, web page (/ui/) and reconciler in one process."""
        argv = [sys.executable, "-m", "deepfleet.controller.server", "--host", host, "--port", str(port)]
        if db:
            argv += ["--db", db]
        if slots:
            argv += ["--slots", str(slots)]
        os.execv(sys.executable, argv + list(ctx.args))

    @app.command()
    def submit(
        job_file: Annotated[Path, typer.Argument(help="Job spec YAML (apiVersion deepfleet/v1, kind TrainingJob).")],
        follow: Annotated[bool, typer.Option("--follow", "-f", help="Show progress until the job ends.")] = False,
        url: UrlOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Submit a job; with --follow, show a progress bar from heartbeats, then the log tail."""
        body = load_job_document(job_file)
        with _client(url, token) as client:
            job = _call(client.submit, body, content_type="application/json")
            typer.echo(f"submitted {job['name']} as {job['id']}")
            if follow:
                raise typer.Exit(follow_job(client, job["id"]))

    @app.command("ls")
    def list_jobs(
        phase: Annotated[str | None, typer.Option(help="Only jobs in this phase.")] = None,
        label: Annotated[list[str] | None, typer.Option(help="key=value; repeat to require several.")] = None,
        limit: Annotated[int, typer.Option(min=1, max=500)] = 50,
        url: UrlOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """List jobs, newest first."""
        from rich.console import Console
        from rich.table import Table

        with _client(url, token) as client:
            page = _call(client.list_jobs, phase=phase, label=label, limit=limit)
        table = Table(box=None)
        for header in ("ID", "NAME", "PHASE", "QUEUE", "ATTEMPT", "CREATED"):
            table.add_column(header, no_wrap=True)  # ids are what every other command takes: never cut
        for j in page["items"]:
            table.add_row(j["id"], j["name"], j["phase"], j["queue"], str(j["attempt"]), j["created_at"][:19])
        console = Console()
        Console(width=max(console.width, 160) if not console.is_terminal else None).print(table)

    @app.command()
    def get(job_id: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
        """Show one job (JSON): its differential privacy spent ("privacy"), its model registration
        ("registration"), and its goodput, lost time by cause, MFU, tokens/s and ETA under "goodput"."""
        with _client(url, token) as client:
            job = _call(client.get, job_id)
            job["goodput"] = _call(client.goodput, job_id)
            typer.echo(json.dumps(job, indent=2))

    @app.command()
    def top(
        all_jobs: Annotated[bool, typer.Option("--all", help="Finished jobs too.")] = False,
        interval: Annotated[float, typer.Option(min=0, help="Refresh every this many seconds; 0: print once.")] = 0,
        limit: Annotated[int, typer.Option(min=1, max=500)] = 20,
        url: UrlOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Training jobs at a glance: step, loss, tokens/s, MFU, goodput, ETA and DP epsilon (newest first)."""
        import time as clock

        from rich.console import Console

        console = Console()
        with _client(url, token) as client:
            while True:
                table = top_table(client, all_jobs=all_jobs, limit=limit)
                if interval and console.is_terminal:
                    console.clear()
                Console(width=max(console.width, 160) if not console.is_terminal else None).print(table)
                if not interval:
                    return
                clock.sleep(interval)

    @app.command()
    def logs(
        job_id: str,
        follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep streaming until the job ends.")] = False,
        node: Annotated[int, typer.Option(min=0)] = 0,
        tail: Annotated[int | None, typer.Option(min=0, help="Only the last N lines.")] = None,
        attempt: Annotated[int | None, typer.Option(min=0, help="Default: the current attempt.")] = None,
        url: UrlOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Print a job's log (one node of one attempt)."""
        with _client(url, token) as client:
            if follow:

                def stream() -> None:
                    for chunk in client.follow_logs(job_id, node=node, tail=tail, attempt=attempt):
                        typer.echo(chunk, nl=False)

                _call(stream)
            else:
                typer.echo(_call(client.logs, job_id, node=node, tail=tail, attempt=attempt), nl=False)

    @app.command()
    def cancel(job_id: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
        """Request a cancel; the controller stops every process of the job."""
        with _client(url, token) as client:
            job = _call(client.cancel, job_id)
        typer.echo(f"cancel requested for {job['name']} ({job['id']}), phase {job['phase']}")

    @app.command()
    def events(job_id: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
        """Print a job's events, oldest first."""
        with _client(url, token) as client:
            for e in _call(client.events, job_id):
                typer.echo(f"{e['time'][:19]}  a{e['attempt'] if e['attempt'] is not None else '-'}  "
                           f"{e['type']:<24} {e['message']}")

    @app.command()
    def provenance(
        job_id: str,
        as_json: Annotated[bool, typer.Option("--json", help="Print the whole chain as JSON.")] = False,
        url: UrlOpt = None, token: TokenOpt = None,
    ) -> None:
        """Print a job's provenance: spec and engine-config hashes, code, versions, data and checkpoint
        lineage, with the hash chain's verification. Exits 1 when the chain does not verify."""
        with _client(url, token) as client:
            chain = _call(client.provenance, job_id)
        if as_json:
            typer.echo(json.dumps(chain, indent=2))
        else:
            _print_provenance(chain)
        if not chain["verified"]:
            for line in chain["problems"]:
                typer.echo(f"TAMPERED: {line}", err=True)
            raise typer.Exit(1)

    @app.command()
    def register(
        model: Annotated[Path, typer.Argument(help="An exported model (safetensors) that carries its job's provenance.")],
        name: Annotated[str, typer.Option("--name", help="Registered model name.")],
        tracking_uri: Annotated[str | None, typer.Option(
            "--tracking-uri", envvar="MLFLOW_TRACKING_URI", help="Default: a local store under --store-dir.")] = None,
        store_dir: Annotated[Path, typer.Option("--store-dir", help="The local store's folder.")] = Path("mlruns"),
    ) -> None:
        """Register an exported model in MLflow's model registry, tagged with its job id and provenance head."""
        from deepfleet.controller.registry import RegistryError, register_model

        try:
            entry = register_model(model, name=name, tracking_uri=tracking_uri, store_dir=store_dir)
        except RegistryError as e:
            typer.echo(str(e), err=True)
            raise typer.Exit(2) from None
        typer.echo(f"registered {entry.name} version {entry.version} (job {entry.job_id}, "
                    f"provenance {entry.provenance_head[:16]}) from {entry.source}")

    token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
    app.add_typer(token_app, name="token")

    @token_app.command("create")
    def token_create(
        name: str,
        role: Annotated[str, typer.Option(help="admin | member | viewer")] = "member",
        project: Annotated[str | None, typer.Option(help="Default: the calling token's project.")] = None,
        expires_in_days: Annotated[float | None, typer.Option(min=0.001)] = None,
        url: UrlOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Create an API token; it is printed once."""
        with _client(url, token) as client:
            created = _call(client.create_token, name, role=role, project=project, expires_in_days=expires_in_days)
        typer.echo(created["token"])

    secret_app = typer.Typer(help="Secrets that local jobs' env entries reference ({secret: NAME}).",
                             no_args_is_help=True)
    app.add_typer(secret_app, name="secret")

    @secret_app.command("set")
    def secret_set(
        name: str,
        from_file: Annotated[Path | None, typer.Option("--from-file", help="Read the value from this file.")] = None,
        url: UrlOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Set a secret of the token's project (admin). The value is read from --from-file or standard
        input, never from the command line (which other users can see)."""
        value = from_file.read_text() if from_file is not None else sys.stdin.read()
        value = value.removesuffix("\n")
        if not value:
            _fail("empty secret value; pipe it on standard input or pass --from-file")
        with _client(url, token) as client:
            _call(client.set_secret, name, value)
        typer.echo(f"secret {name} set")

    @secret_app.command("ls")
    def secret_ls(url: UrlOpt = None, token: TokenOpt = None) -> None:
        """List the project's secret names (never their values)."""
        with _client(url, token) as client:
            for s in _call(client.list_secrets):
                typer.echo(f"{s['name']:<40} {s['updated_at'][:19]}  {s['updated_by'] or ''}")

    @secret_app.command("rm")
    def secret_rm(name: str, url: UrlOpt = None, token: TokenOpt = None) -> None:
        """Delete a secret (admin)."""
        with _client(url, token) as client:
            _call(client.delete_secret, name)
        typer.echo(f"secret {name} deleted")


def top_table(client: Any, *, all_jobs: bool, limit: int) -> Any:
    """The `deepfleet top` table: one row per job, figures from its goodput (rich Table)."""
    from rich.table import Table

    finished = {"SUCCEEDED", "FAILED", "CANCELLED"}
    jobs = [j for j in _call(client.list_jobs, limit=limit)["items"] if all_jobs or j["phase"] not in finished]
    table = Table(box=None)
    for header in ("ID", "NAME", "PHASE", "STEP", "LOSS", "TOKENS/S", "MFU", "GOODPUT", "ETA", "EPSILON"):
        table.add_column(header, no_wrap=True)
    for j in jobs:
        g = _call(client.goodput, j["id"])
        detail = _call(client.get, j["id"])
        hb = detail.get("last_heartbeat") or {}
        step = "-" if j["step"] is None else f"{j['step']}" + (f"/{j['max_steps']}" if j["max_steps"] else "")
        table.add_row(
            j["id"], j["name"], j["phase"], step, _fmt(hb.get("loss"), "{:.4f}"), _fmt(g["tokens_per_s"], "{:,.0f}"),
            _fmt(g["mfu"], "{:.1%}"), _fmt(g["goodput"], "{:.1%}"), _duration(g["eta_s"]),
            _fmt((detail.get("privacy") or {}).get("epsilon"), "{:.3g}"))
    return table


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def follow_job(client: Any, job_id: str, *, poll_s: float = 1.0, tail: int = 20) -> int:
    """Show a live progress line (phase, step, loss, tokens/s from heartbeats) until the job ends, then the
    log tail; returns the exit code for the shell (0 only when SUCCEEDED)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn())
    steps = _max_steps(client, job_id)
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("PENDING", total=steps, info="")
        while True:
            job = _call(client.get, job_id)
            hb = job.get("last_heartbeat") or {}
            info = ""
            if hb:
                info = f"step {hb.get('step')}"
                if hb.get("loss") is not None:
                    info += f" loss {hb['loss']:.4f}"
                if hb.get("tokens_per_s") is not None:
                    info += f" {hb['tokens_per_s']:.0f} tok/s"
            progress.update(task, description=f"{job['phase']:<10} a{job['attempt']}", info=info,
                            completed=hb.get("step") or 0)
            if job["phase"] in TERMINAL:
                if job["phase"] == "SUCCEEDED" and steps:
                    progress.update(task, completed=steps)
                break
            time.sleep(poll_s)
    try:
        console.print(f"--- last {tail} log lines (node 0) ---")
        typer.echo(client.logs(job_id, tail=tail), nl=False)
    except Exception as e:  # best effort: a job cancelled before it started has no log
        console.print(f"(no log: {e})")
    console.print(f"{job['name']} {job['phase']}: {job['message']}")
    return 0 if job["phase"] == "SUCCEEDED" else EXIT_FAILED


def _max_steps(client: Any, job_id: str) -> int | None:
    """The job's step budget (`spec.maxSteps`), else a script's `--steps N` / `--max-steps N`, if given."""
    spec = _call(client.get, job_id)["spec"]["spec"]
    if spec.get("maxSteps"):
        return int(spec["maxSteps"])
    args = spec["entrypoint"].get("args", [])
    args = args if isinstance(args, list) else []
    for i, arg in enumerate(args):
        if arg in ("--steps", "--max-steps", "--max_steps") and i + 1 < len(args) and args[i + 1].isdigit():
            return int(args[i + 1])
        if arg.startswith(("--steps=", "--max-steps=")) and arg.split("=", 1)[1].isdigit():
            return int(arg.split("=", 1)[1])
    return None


def _print_provenance(chain: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"provenance of job {chain['job_id']}", show_lines=False)
    for column in ("seq", "kind", "attempt", "time", "what", "hash"):
        table.add_column(column)
    for r in chain["records"]:
        table.add_row(str(r["seq"]), r["kind"], "-" if r["attempt"] is None else str(r["attempt"]), r["time"][:19],
                      _summary(r["kind"], r["data"]), r["hash"][:16])
    console = Console(width=160)
    console.print(table)
    console.print(f"head {chain['head']}  " + ("verified" if chain["verified"] else "NOT VERIFIED"))


def _summary(kind: str, d: dict) -> str:
    if kind == "submit":
        engine = d.get("engine_config_sha256")
        return (f"spec sha256 {d['spec_sha256'][:16]}, engine config "
                f"{engine[:16] if engine else 'none inline'}, deepfleet {d.get('deepfleet_version')}")
    if kind == "attempt":
        code = d.get("code") or {}
        ident = code.get("image_digest") or code.get("image") or code.get("file_sha256") or "unknown code"
        commit = f", git {code['git_commit'][:12]}" if code.get("git_commit") else ""
        resumed = d.get("resumed_from")
        return f"{d['backend']} {d['run_name']}: {ident}{commit}" + (f"; resumes {resumed}" if resumed else "")
    if kind == "runtime":
        return f"torch {d['torch_version']}"
    if kind == "dataset":
        return f"{d['uri']} {d['digest']}"
    return f"checkpoint {d['tag']} at step {d['step']}"
