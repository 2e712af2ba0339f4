"""The local backend: every node of a run is a `deepfleet-worker` subprocess on this machine.

Called by `controller.reconciler` through the `Backend` protocol (and by `controller.demo` through the
server). Each node runs in its own session (`start_new_session`) under a one-line `sh` wrapper that
writes the node's exit status to `node-<i>.exit` when it ends, so the status survives the
controller: a restarted controller reads it from disk instead of needing to be the parent. A run's
directory `<logs_dir>/<name>/` (the controller's own) holds `state.json` (pids, rendezvous port) and
`node-<i>.log`. The nodes meet at a real c10d rendezvous store on 127.0.0.1 and a free port.

This backend runs user code on the controller's host. What keeps a job to itself (see
`controller.confine` and docs/security.md):
- a clean environment: only the worker contract (`DEEPFLEET_WORKER_SPEC`, the job-scoped token, the
  rendezvous variables), the job's own `env` (plain values inside the WorkerSpec; secret references
  resolved through `secrets` straight into the processes' environment) and `PATH`/`LANG`-style
  variables listed in `env_passthrough`; nothing of the controller's own environment (database URL,
  admin token, signing key) reaches it;
- its own session, and, when the controller runs as root, an unprivileged user (`run_as`);
- a job area `<jobs_dir>/<project>/<job id>/` made for it: `work/` (working directory, HOME, TMPDIR),
  `checkpoints/` (where `checkpoint.dir` resolves) and `status/` (the exit files); the script path
  resolves inside the project's code directory, symlinks included.

A succeeded run's exported model (`spec.registerModel`) is handed to the registry from the job area
(`exported_model`: `<checkpoint.dir>/export/`, its export.json and the file it names, every path resolved
inside the area and opened without following links, since the job wrote them).

Cancel sends SIGTERM to every node's process group and to every process whose environment carries
`DEEPFLEET_LOCAL_RUN=<name>` (torchrun's elastic agent starts its training processes in new
sessions, so a process group alone does not reach them), waits a grace period, then SIGKILLs what
is left. Hand-written on `subprocess`/`os` because no library manages detached, restart-surviving
process groups with recorded exit codes (supervisord/systemd are daemons, not libraries).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from deepfleet.controller.backends.base import BackendError, Observation, RunPhase, Submission
from deepfleet.controller.confine import (
    ConfineError,
    JobArea,
    code_dir_for,
    copy_resume_checkpoint,
    job_area,
    job_area_path,
    resolve_inside,
    user_ids,
)
from deepfleet.controller.registry import ExportedModel, RegistryError
from deepfleet.controller.spec import secret_refs
from deepfleet.worker.spec import (
    ENDPOINT_FILE_ENV,
    EXPORT_MANIFEST,
    EXPORT_SUBDIR,
    FACTORY_MODULES_ENV,
    PORT_FILE_ENV,
    SPEC_ENV,
    ExportManifest,
    FailureClass,
    classify_exit,
)

if TYPE_CHECKING:
    from deepfleet.controller.spec import JobSpec

RUN_ENV = "DEEPFLEET_LOCAL_RUN"
# Runs the worker, then records its exit status (128+N for a signal, as the shell reports it).
# Children of dropped backends (a controller replica replaced, a test's backend gone) whose exit is not
# collected yet: every backend polls these too, so neither zombies nor 'still running' Popen warnings remain.
_ORPHANS: list[subprocess.Popen[bytes]] = []


def _collect(children: dict[int, subprocess.Popen[bytes]]) -> None:
    """Poll every child (and every orphan); forget those that exited."""
    for pid, proc in list(children.items()):
        if proc.poll() is not None:
            children.pop(pid, None)
    _ORPHANS[:] = [proc for proc in _ORPHANS if proc.poll() is None]


def _orphan(children: dict[int, subprocess.Popen[bytes]]) -> None:
    _collect(children)
    _ORPHANS.extend(children.values())
    children.clear()


_WRAPPER = 'rc=0; "$@" || rc=$?; printf "%s" "$rc" > "$DF_EXIT_FILE.tmp"; mv "$DF_EXIT_FILE.tmp" "$DF_EXIT_FILE"; exit $rc'
_SIGKILLED = 128 + signal.SIGKILL
KILL_WAIT_S = 15.0  # how long cancel waits for SIGKILLed processes to be gone
# The controller's variables a Python process needs to start; nothing else of its environment passes.
DEFAULT_PASSTHROUGH = ("PATH", "LANG", "LC_ALL", "TZ", "OMP_NUM_THREADS")


def default_worker_command() -> list[str]:
    """The `deepfleet-worker` console script next to this interpreter (falls back to PATH)."""
    beside = Path(sys.executable).with_name("deepfleet-worker")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("deepfleet-worker")
    return [found] if found else [sys.executable, "-m", "deepfleet.worker.cli"]


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _marked(name: str) -> list[int]:
    """Pids of this user's processes whose environment has DEEPFLEET_LOCAL_RUN=<name>."""
    needle = f"{RUN_ENV}={name}\0".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes() + b"\0":
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _read_exit(path: Path) -> tuple[int, float] | None:
    """(exit status, mtime) from a node's exit file, or None while there is none. The file lives where
    the job can write, so it is opened without following links and read as at most a few digits."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        return _SIGKILLED, 0.0  # a link or something else planted there: count the node as lost
    with os.fdopen(fd, "rb") as f:
        text = f.read(8).strip()
        mtime = os.fstat(f.fileno()).st_mtime
    return (int(text) if text.isdigit() and int(text) < 256 else _SIGKILLED), mtime


def _read_endpoint(path: Path) -> str | None:
    """A serving node's URL from its endpoint file (None while there is none). The job writes the file, so
    it is opened without following links, read as at most 256 bytes and must be a loopback http URL."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        text = f.read(256).decode("ascii", "replace").strip()
    host, _, port = text.removeprefix("http://").partition(":")
    return text if host == "127.0.0.1" and port.isdigit() and 0 < int(port) < 65536 else None


def _read_manifest(path: Path) -> ExportManifest:
    """A worker's export.json, opened without following a link and read as at most 64 KiB."""
    from pydantic import ValidationError

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise RegistryError(f"{path} is missing: node 0 wrote no export (its log says why)") from None
    except OSError as e:
        raise RegistryError(f"{path}: cannot open it ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        text = f.read(64 * 1024)
    try:
        return ExportManifest.model_validate_json(text)
    except ValidationError as e:
        raise RegistryError(f"{path}: not an export manifest ({e.error_count()} problems)") from None


class LocalBackend:
    """Runs jobs as local processes. `slots`: how many training processes may run at once (capacity)."""

    name = "local"

    def __init__(
        self,
        logs_dir: Path,
        *,
        slots: int = 4,
        workdir: Path | str | None = None,
        jobs_dir: Path | None = None,
        run_as: str | int | None = None,
        project_users: Mapping[str, str] | None = None,
        env_passthrough: tuple[str, ...] = DEFAULT_PASSTHROUGH,
        factory_modules: tuple[str, ...] = (),
        worker_command: list[str] | None = None,
        secrets: Callable[[str, str], str] | None = None,
        cancel_grace_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`workdir`: the code directory scripts and factories resolve in (`{project}` in it names the
        project's own); `jobs_dir`: where job areas live (default `<logs_dir>/../jobs`); `run_as`: the user
        (name or uid) that runs jobs, None for the controller's own; `project_users`: a user per project instead
        of `run_as` (jobs of different projects then cannot see each other's processes or files); `factory_modules`: module prefixes a
        factory may also name besides the code directory's own modules (admin allow-list); `secrets`:
        `(project, name) -> value` for the spec's `env` secret references (raises LookupError)."""
        self.logs_dir = Path(logs_dir)
        self.slots = slots
        self.workdir = str(workdir) if workdir else str(Path.cwd())
        self.jobs_dir = Path(jobs_dir) if jobs_dir else self.logs_dir.parent / "jobs"
        self.run_as = run_as
        self.project_users = dict(project_users or {})
        self.env_passthrough = tuple(env_passthrough)
        self.factory_modules = tuple(factory_modules)
        self.worker_command = worker_command or default_worker_command()
        self.secrets = secrets
        self.cancel_grace_s = cancel_grace_s
        self._clock = clock
        self._sleep = sleep
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        # Another replica may observe a run this one started, so this one never reaps it there: every
        # entry point collects exited children, and a dropped backend hands the rest on (`_ORPHANS`).
        weakref.finalize(self, _orphan, self._children)

    # ------------------------------------------------------------------ paths and state
    def run_dir(self, name: str) -> Path:
        if not self.logs_dir.is_dir():
            self.logs_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.logs_dir.stat().st_mode & 0o077:
            os.chmod(self.logs_dir, 0o700)  # jobs must not list or read other runs' logs and state
        return self.logs_dir / name

    def log_path(self, name: str, node: int) -> Path:
        return self.run_dir(name) / f"node-{node}.log"

    def _state(self, name: str) -> dict | None:
        try:
            return json.loads((self.run_dir(name) / "state.json").read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError) as e:
            raise BackendError(f"local run {name}: unreadable state.json ({e})") from e

    def _write_state(self, name: str, state: dict) -> None:
        path = self.run_dir(name) / "state.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)

    # ------------------------------------------------------------------ Backend protocol
    def submit(self, sub: Submission) -> None:
        """Start one process per node. Idempotent: a complete run of that name is left alone; a run
        whose start was interrupted (controller crash mid-submit) is cleaned up and started again."""
        _collect(self._children)
        state = self._state(sub.name)
        if state is not None and state.get("complete"):
            return
        if state is not None:
            # A start cut short (controller crash): stop what did start, keep its logs aside, start afresh.
            self._kill(sub.name, state)
            for log in self.run_dir(sub.name).glob("node-*.log"):
                os.replace(log, log.with_name(log.name + ".interrupted"))
        project = sub.spec.metadata.project
        try:
            owner = self._owner(project)
            area = job_area(self.jobs_dir, project=project, job_id=sub.job_id, owner=owner)
            ws = self._confined_spec(sub, area, owner=owner)
        except ConfineError as e:
            raise BackendError(f"local run {sub.name}: {e}", transient=False) from e
        secret_env = self._secret_env(sub, project)
        nodes = sub.worker_spec.nodes.max
        # Port 0: node 0's worker binds the rendezvous store on a port the kernel picks and publishes it
        # in the port file, which the other nodes read (worker/rendezvous.py), so no port is picked first
        # and bound later.
        ws = ws.model_copy(update={"rendezvous": ws.rendezvous.model_copy(update={"endpoint": None, "port": 0})})
        port_file = area.status / f"{sub.name}.rdzv-port"
        port_file.unlink(missing_ok=True)
        serve_env: dict[str, str] = {}
        endpoint_file = area.status / f"{sub.name}.endpoint"
        endpoint_file.unlink(missing_ok=True)
        if ws.serve is not None:
            # The endpoint binds a free port itself (no race) and reports its URL through the file.
            ws = ws.model_copy(update={"serve_address": "127.0.0.1:0"})
            serve_env[ENDPOINT_FILE_ENV] = str(endpoint_file)
        run = self.run_dir(sub.name)
        run.mkdir(mode=0o700, parents=True, exist_ok=True)
        for stale in area.status.glob(f"{sub.name}.node-*.exit"):
            stale.unlink()
        state = {"name": sub.name, "job_id": sub.job_id, "attempt": sub.attempt, "nodes": nodes,
                 "min_nodes": sub.worker_spec.nodes.min, "port_file": str(port_file), "pids": [], "complete": False,
                 "status_dir": str(area.status), "serving": ws.serve is not None}
        self._write_state(sub.name, state)  # the intent first: a crash from here on is found by submit/cancel
        base = {**self._passthrough(), **secret_env, **sub.env, **self._area_env(area), **serve_env,
                SPEC_ENV: json.dumps(ws.model_dump(mode="json", exclude_none=True)), RUN_ENV: sub.name}
        user = {"user": owner[0], "group": owner[1], "extra_groups": []} if owner else {}
        try:
            for node in range(nodes):
                env = {
                    **base,
                    "DEEPFLEET_NODE_RANK": str(node),
                    "DEEPFLEET_NNODES": str(nodes),
                    "DEEPFLEET_MASTER_ADDR": "127.0.0.1",
                    "DEEPFLEET_MASTER_PORT": "0",
                    PORT_FILE_ENV: str(port_file),
                    "DF_EXIT_FILE": str(self._exit_file(state, node)),
                }
                fd = os.open(self.log_path(sub.name, node), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                with os.fdopen(fd, "ab") as log:
                    proc = subprocess.Popen(
                        ["/bin/sh", "-c", _WRAPPER, "sh", *self.worker_command],
                        env=env,
                        cwd=area.work,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # own session: cancel is one killpg per node
                        **user,
                    )
                self._children[proc.pid] = proc
                state["pids"].append(proc.pid)
                self._write_state(sub.name, state)
        except OSError as e:
            self._kill(sub.name, state)
            raise BackendError(f"local run {sub.name}: cannot start {self.worker_command[0]} ({e})",
                               transient=False) from e
        state["complete"] = True
        self._write_state(sub.name, state)

    def observe(self, name: str) -> Observation:
        """FAILED as soon as fewer than `nodes.min` nodes remain (any non-zero exit of a fixed-size run;
        classified by the earliest failure), SUCCEEDED when every remaining node exited 0, RUNNING
        otherwise."""
        _collect(self._children)
        state = self._state(name)
        if state is None:
            return Observation(RunPhase.NOT_FOUND, message=f"no local run {name}")
        if not state.get("complete"):
            # Submits run to completion within one reconciler call, and the job's claim keeps other
            # replicas away meanwhile; an incomplete state seen here is a start a crash cut short.
            return Observation(RunPhase.NOT_FOUND, message=f"start of {name} was interrupted; resubmit it")
        codes: dict[int, int] = {}
        failed_at: dict[int, float] = {}
        for node, pid in enumerate(state["pids"]):
            self._reap(pid)
            recorded = _read_exit(self._exit_file(state, node))
            if recorded is not None:
                self._reap(pid, wait_s=2.0)  # the wrapper exits right after writing the file
                codes[node], failed_at[node] = recorded
            elif not _alive(pid):
                # Read again: the wrapper may have recorded and exited between the read and the check.
                # Without a record it was killed itself before it could write one.
                codes[node], failed_at[node] = _read_exit(self._exit_file(state, node)) or (_SIGKILLED, 0.0)
        bad = {n: c for n, c in codes.items() if c != 0}
        remaining = state["nodes"] - len(bad)  # nodes still running or finished cleanly
        if bad:
            first = min(bad, key=lambda n: (failed_at[n], n))
            tail = "".join(self._tail(name, first, 50))
            fc = classify_exit(bad[first], log_tail=tail)
            lost = f"node {first} exited {bad[first]} ({fc.value})"
            # An elastic run (nodes min < max) carries on while at least `min` nodes remain: torchrun's
            # agents on the survivors re-form a smaller group and reshard from the checkpoint.
            if remaining < state.get("min_nodes", state["nodes"]):
                return Observation(RunPhase.FAILED, exit_codes=codes, failure_class=fc, message=lost)
            if len(codes) < state["nodes"]:
                return Observation(RunPhase.RUNNING, exit_codes=codes,
                                   message=f"{lost}; continuing on {remaining} of {state['nodes']} nodes")
            return Observation(RunPhase.SUCCEEDED, exit_codes=codes, failure_class=FailureClass.SUCCEEDED,
                               message=f"{lost}; finished on {remaining} of {state['nodes']} nodes")
        if len(codes) == state["nodes"]:
            return Observation(RunPhase.SUCCEEDED, exit_codes=codes, failure_class=FailureClass.SUCCEEDED)
        if state.get("serving"):
            # A serving run counts as running once its endpoint listens (loading the model comes first).
            endpoint = _read_endpoint(Path(state["status_dir"]) / f"{name}.endpoint")
            if endpoint is None:
                return Observation(RunPhase.PENDING, exit_codes=codes, message="loading the model")
            return Observation(RunPhase.RUNNING, exit_codes=codes, endpoint=endpoint)
        return Observation(RunPhase.RUNNING, exit_codes=codes)

    def cancel(self, name: str) -> None:
        """Stop every process of the run (SIGTERM, then SIGKILL after the grace period) and forget it;
        its logs stay. Idempotent."""
        state = self._state(name)
        if state is None:
            return
        self._kill(name, state)
        (self.run_dir(name) / "state.json").unlink(missing_ok=True)

    def logs(self, name: str, *, node: int = 0, tail: int | None = None, follow: bool = False) -> Iterator[str]:
        path = self.log_path(name, node)
        if not path.exists():
            raise BackendError(f"local run {name} has no log for node {node}", transient=False)
        if not follow:
            yield from self._tail(name, node, tail)
            return
        with open(path, errors="replace") as f:
            lines = f.readlines()
            yield from lines[-tail:] if tail is not None else lines
            while True:
                line = f.readline()
                if line:
                    yield line
                    continue
                if self.observe(name).phase not in (RunPhase.RUNNING, RunPhase.PENDING):
                    yield from f.readlines()
                    return
                self._sleep(0.2)

    def exported_model(self, run_name: str, *, job_id: str, spec: JobSpec) -> ExportedModel:
        """The model node 0 exported into the job's area (`<checkpoint.dir>/export/`), as its manifest names
        it. The area is the job's to write: every path is resolved inside it and no link is followed."""
        if spec.spec.checkpoint is None:
            raise RegistryError("the job has no checkpoint directory, so nothing was exported")
        area = job_area_path(self.jobs_dir, project=spec.metadata.project, job_id=job_id)
        try:
            folder = resolve_inside(area.checkpoints, str(PurePosixPath(spec.spec.checkpoint.dir) / EXPORT_SUBDIR),
                                    field="spec.checkpoint.dir")
            manifest = _read_manifest(folder / EXPORT_MANIFEST)
            if manifest.error:
                raise RegistryError(f"run {run_name} exported no model: {manifest.error}")
            if manifest.job_id != job_id or not manifest.file or "/" in manifest.file:
                raise RegistryError(f"{folder / EXPORT_MANIFEST}: names job {manifest.job_id} and file "
                                    f"{manifest.file!r}; it is not this job's export")
            path = resolve_inside(folder, manifest.file, field="export.json file")
        except ConfineError as e:
            raise RegistryError(str(e)) from None
        return ExportedModel(path=path, manifest=manifest.model_dump(mode="json", exclude_none=True))

    # ------------------------------------------------------------------ confinement
    def _confined_spec(self, sub: Submission, area: JobArea, *, owner: tuple[int, int] | None):
        """The WorkerSpec with the script and checkpoint paths resolved inside the code directory and the
        job area. Raises ConfineError when a path escapes them."""
        ws = sub.worker_spec
        code = code_dir_for(self.workdir, project=sub.spec.metadata.project)
        update: dict = {}
        entry = ws.entrypoint
        if hasattr(entry, "script"):
            script = resolve_inside(code, entry.script, field="spec.entrypoint.script")
            update["entrypoint"] = entry.model_copy(update={"script": str(script)})
        if ws.checkpoint is not None:
            ckpt = resolve_inside(area.checkpoints, ws.checkpoint.dir, field="spec.checkpoint.dir")
            update["checkpoint"] = ws.checkpoint.model_copy(update={"dir": str(ckpt)})
            source = sub.spec.spec.checkpoint.resume_from if sub.spec.spec.checkpoint else None
            if source and not (ckpt / "latest").exists():
                src = job_area_path(self.jobs_dir, project=area.project, job_id=source)
                if copy_resume_checkpoint(src, into=ckpt) is not None and owner is not None:
                    for path in [ckpt, *ckpt.rglob("*")]:
                        os.chown(path, *owner, follow_symlinks=False)
            if ws.serve is not None and not (ckpt / "latest").exists():
                raise ConfineError(f"spec.model.job: job {source} of project {area.project} has no complete "
                                   "checkpoint; serve a job that saved one")
        return ws.model_copy(update=update) if update else ws

    def _secret_env(self, sub: Submission, project: str) -> dict[str, str]:
        """The values of the spec's secret references, for the processes' environment only (never the
        WorkerSpec, the state file or a log line)."""
        refs = secret_refs(sub.spec)
        if refs and self.secrets is None:
            raise BackendError(f"local run {sub.name}: spec.env references secrets but this controller has no "
                               "secret store; run it with `deepfleet server`", transient=False)
        out = {}
        for var, ref in refs.items():
            try:
                out[var] = self.secrets(project, ref.secret)  # type: ignore[misc]
            except LookupError as e:
                raise BackendError(f"local run {sub.name}: spec.env.{var}: {e}", transient=False) from None
        return out

    def _area_env(self, area: JobArea) -> dict[str, str]:
        code = code_dir_for(self.workdir, project=area.project)
        env = {"HOME": str(area.work), "TMPDIR": str(area.tmp), "PYTHONPATH": str(code)}
        if self.factory_modules:
            env[FACTORY_MODULES_ENV] = ",".join(self.factory_modules)
        return env

    def _passthrough(self) -> dict[str, str]:
        return {k: os.environ[k] for k in self.env_passthrough if k in os.environ}

    def _owner(self, project: str) -> tuple[int, int] | None:
        """(uid, gid) the project's jobs run as, or None for the controller's own user."""
        user = self.project_users.get(project, self.run_as)
        return None if user is None else user_ids(user)

    def _exit_file(self, state: dict, node: int) -> Path:
        return Path(state["status_dir"]) / f"{state['name']}.node-{node}.exit"

    # ------------------------------------------------------------------ helpers
    def _tail(self, name: str, node: int, n: int | None) -> list[str]:
        try:
            lines = self.log_path(name, node).read_text(errors="replace").splitlines(keepends=True)
        except FileNotFoundError:
            return []
        return lines[-n:] if n is not None else lines

    def _reap(self, pid: int, *, wait_s: float = 0.0) -> None:
        """Collect our own child's exit (no zombies; no 'still running' Popen left behind)."""
        proc = self._children.get(pid)
        if proc is None:
            return
        try:
            proc.wait(timeout=wait_s) if wait_s else proc.poll()
        except subprocess.TimeoutExpired:
            return
        if proc.returncode is not None:
            del self._children[pid]

    def _kill(self, name: str, state: dict) -> None:
        seen: set[int] = set(state.get("pids", []))

        def targets() -> set[int]:
            # A process once seen stays a target until it is gone: an exiting process has already
            # released its memory, environment included, so it no longer reads as marked while the
            # kernel is still tearing it down.
            seen.update(_marked(name))
            return {p for p in seen if _alive(p)}

        self._signal(state.get("pids", []), targets(), signal.SIGTERM)
        deadline = self._clock() + self.cancel_grace_s
        while targets() and self._clock() < deadline:
            self._sleep(0.05)
            for pid in state.get("pids", []):
                self._reap(pid)
        left = targets()
        if left:
            self._signal(state.get("pids", []), left, signal.SIGKILL)
            # A killed process stays listed until the kernel has torn it down, which on a busy host takes
            # a while, and one started in the meantime (a restarting agent's) is killed too: cancel returns
            # once none is left, so CANCELLED means nothing of the run still runs.
            deadline = self._clock() + KILL_WAIT_S
            while (left := targets()) and self._clock() < deadline:
                self._sleep(0.05)
                self._signal([], left, signal.SIGKILL)
                for pid in state.get("pids", []):
                    self._reap(pid)
        for pid in state.get("pids", []):
            proc = self._children.pop(pid, None)
            if proc is not None:
                proc.wait(timeout=5)

    @staticmethod
    def _signal(leaders: list[int], pids: set[int], sig: signal.Signals) -> None:
        for pid in leaders:
            try:
                os.killpg(pid, sig)  # each node leads its own group (start_new_session)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
