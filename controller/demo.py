"""`make demo`: one command that runs a real job end to end on this machine.

Run as `python -m deepfleet.controller.demo` (the Makefile's `demo` target). It starts a controller
process (SQLite + the local backend, on a free port of 127.0.0.1, data under `runs/demo-<time>/`),
submits `examples/gpt/job.yaml` (tiny GPT, 2 worker processes, ZeRO stage 2) through the HTTP API
exactly as `deepfleet submit --follow` does, shows a progress bar from the job's heartbeats until it
ends, and prints where the checkpoint and the logs are. Then, when run from a terminal, it keeps the
controller up and prints the job's page, a ready API token and the CLI settings, until Ctrl-C; when
not (CI, a pipe), or with `--exit` / DEEPFLEET_DEMO_EXIT=1, it stops the controller at once, so the
command always ends. Exit status 0 only when the job SUCCEEDED.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx

from deepfleet.controller.cli_jobs import follow_job, load_job_document
from deepfleet.controller.client import Client

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "gpt" / "job.yaml"


def _listener() -> socket.socket:
    """A listening socket on a port of 127.0.0.1 the kernel picks, handed to the controller as is (no
    port is picked first and bound later)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def start_controller(data_dir: Path, listener: socket.socket) -> subprocess.Popen[bytes]:
    """The controller as a child process serving on `listener` (closed here once the child holds its
    copy); returns once it answers /readyz (or raises with its log)."""
    port = listener.getsockname()[1]
    data_dir.mkdir(parents=True, exist_ok=True)
    log = open(data_dir / "controller.log", "ab")  # noqa: SIM115 - closed by stop_controller's caller exit
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DEEPFLEET_DATABASE_URL", None)
    env.pop("DATABASE_URL", None)  # the demo is the embedded default: SQLite in data_dir
    proc = subprocess.Popen(
        [sys.executable, "-m", "deepfleet.controller.server", "--port", str(port), "--fd", str(listener.fileno()),
         "--data-dir", str(data_dir), "--workdir", str(ROOT), "--slots", "2", "--heartbeat-interval", "1",
         "--reconcile-interval", "0.5"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, pass_fds=[listener.fileno()],
    )
    listener.close()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the controller exited {proc.returncode}; see {data_dir / 'controller.log'}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"the controller did not become ready; see {data_dir / 'controller.log'}")


def stop_controller(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down cleanly; the reconciler thread stops first
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", type=Path, default=JOB, help="job spec to run (default examples/gpt/job.yaml)")
    p.add_argument("--data-dir", type=Path, default=None, help="default runs/demo-<time>/")
    p.add_argument("--exit", action="store_true",
                   help="stop the controller when the job ends (default when stdin is not a terminal)")
    args = p.parse_args(argv)
    stay = not (args.exit or os.environ.get("DEEPFLEET_DEMO_EXIT") or not sys.stdin.isatty())
    data_dir = (args.data_dir or ROOT / "runs" / f"demo-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    document = json.loads(load_job_document(args.job))
    listener = _listener()
    port = listener.getsockname()[1]
    print(f"starting the controller (SQLite + local backend) at http://127.0.0.1:{port}/ui/ ...", flush=True)
    proc = start_controller(data_dir, listener)
    url = f"http://127.0.0.1:{port}"
    try:
        token = (data_dir / "admin-token").read_text().strip()
        with Client(url, token=token) as client:
            job = client.submit(json.dumps(document), content_type="application/json")
            print(f"submitted {job['name']} ({job['id']}): {document['spec']['nodes']} nodes x "
                  f"{document['spec'].get('processesPerNode', 1)} process(es)", flush=True)
            code = follow_job(client, job["id"], poll_s=0.5)
            final = client.get(job["id"])
        _summary(final, document, data_dir)
        if stay:
            _serve_until_interrupted(proc, url=url, token=token, job_id=final["id"])
    finally:
        stop_controller(proc)
    return code


def _serve_until_interrupted(proc: subprocess.Popen[bytes], *, url: str, token: str, job_id: str) -> None:
    print(f"\nthe controller stays up: open {url}/ui/#/jobs/{job_id}\n"
          f"  token (paste it on the page when asked): {token}\n"
          f"  CLI: export DEEPFLEET_URL={url} DEEPFLEET_API_TOKEN={token}; deepfleet ls\n"
          "press Ctrl-C to stop it", flush=True)
    try:
        proc.wait()
        print(f"the controller exited {proc.returncode}", flush=True)
    except KeyboardInterrupt:
        print("\nstopping the controller", flush=True)


def _summary(final: dict, document: dict, data_dir: Path) -> None:
    attempt = final["attempts"][-1]["run_name"] if final["attempts"] else None
    # Each job checkpoints inside its own area, so the demo trains from step 0 every time.
    ckpt = (document["spec"].get("checkpoint") or {}).get("dir", "")
    checkpoint_dir = data_dir / "jobs" / final["project"] / final["id"] / "checkpoints" / ckpt
    latest = checkpoint_dir / "latest"
    print(f"job {final['name']}: {final['phase']} after {len(final['attempts'])} attempt(s)")
    if latest.exists():
        print(f"checkpoint: {checkpoint_dir / latest.read_text().strip()}")
    if attempt:
        print(f"logs:       {data_dir / 'logs' / attempt}/node-<i>.log")
    print(f"controller: {data_dir / 'controller.log'} (database {data_dir / 'deepfleet.db'})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
