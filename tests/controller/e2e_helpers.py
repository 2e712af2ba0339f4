"""End-to-end helpers: a real controller process (`python -m deepfleet.controller.server`, uvicorn on
127.0.0.1) on a given database, talked to over HTTP with the real client, and process inspection for
the local backend's runs."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deepfleet.controller.client import Client
from tests.controller.conftest import ADMIN_TOKEN

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


class Controller:
    """One controller process. `kill()` is a crash (SIGKILL); `stop()` a clean shutdown."""

    def __init__(self, db_url: str, data_dir: Path, *, worker_command: list[str] | None = None,
                 replica: str = "c1", lease_seconds: float = 3.0, workdir: Path | None = None,
                 heartbeat_interval: float = 0.5, extra_env: dict[str, str] | None = None,
                 tls: tuple[Path, Path] | None = None) -> None:
        """`extra_env` overrides the controller's environment (by default jobs run as the test's own user,
        `DEEPFLEET_LOCAL_USER` empty, since pytest's temporary directories are not reachable by others)."""
        # The test binds the listening socket (port 0) and hands it to the server: no port race.
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        self.port = listener.getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log = data_dir / f"controller-{replica}-{self.port}.log"
        env = {**os.environ, "DEEPFLEET_ADMIN_TOKEN": ADMIN_TOKEN, "DEEPFLEET_ADMIN_PROJECT": "test",
               "DEEPFLEET_SECRET": "e2e-secret", "DEEPFLEET_LEASE_SECONDS": str(lease_seconds),
               "OMP_NUM_THREADS": "1", "DEEPFLEET_LOCAL_USER": "", **(extra_env or {})}
        argv = [sys.executable, "-m", "deepfleet.controller.server", "--db", db_url, "--port", str(self.port),
                "--fd", str(listener.fileno()),
                "--data-dir", str(data_dir), "--slots", "16", "--reconcile-interval", "0.2",
                "--replica-id", replica, "--heartbeat-interval", str(heartbeat_interval)]
        if workdir is not None:
            argv += ["--workdir", str(workdir)]
        if tls is not None:  # (certificate, key); the certificate is also the CA the test trusts
            argv += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
        if worker_command is not None:
            argv += ["--worker-command", " ".join(worker_command)]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         pass_fds=[listener.fileno()])
        listener.close()  # the server holds its own copy
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"controller exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/v1/jobs", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                             timeout=1, verify=ssl.create_default_context(cafile=tls[0]) if tls else True).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            self.kill()
            raise RuntimeError(f"controller did not answer:\n{self.log.read_text()[-3000:]}")
        self.client = Client(self.url, token=ADMIN_TOKEN, ca_bundle=str(tls[0]) if tls else None)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.client.close()


def wait_phase(client: Client, job_id: str, phases: set[str], *, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    job = client.get(job_id)
    while time.monotonic() < deadline:
        job = client.get(job_id)
        if job["phase"] in phases:
            return job
        time.sleep(0.1)
    events = [f"{e['type']}: {e['message']}" for e in client.events(job_id)]
    raise AssertionError(f"job {job_id} stayed {job['phase']} ({job['message']}); events {events}")


def node_pids(run: str, node: int, needle: str) -> list[int]:
    """Pids of run `run`'s node `node` whose command line contains `needle` (e.g. the worker script)."""
    marker = f"DEEPFLEET_LOCAL_RUN={run}\0".encode()
    rank = f"DEEPFLEET_NODE_RANK={node}\0".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes() + b"\0"
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in environ and rank in environ and needle in cmdline and not cmdline.startswith("/bin/sh"):
            out.append(int(entry.name))
    return out


def starts(logs_dir: Path, run: str, node: int, needle: str) -> int:
    """How many times a node of a run was started (the worker prints `needle` once per start)."""
    log = logs_dir / run / f"node-{node}.log"
    return log.read_text().count(needle) if log.exists() else 0
