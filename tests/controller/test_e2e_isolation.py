"""A job attacks its host from inside, against a real controller process running as root (SQLite, local
backend, PostgreSQL): what the job's environment holds, which user and session it runs in, what it can read and write
(checked from inside the job and on the filesystem after the run), and that no token or secret shows up in
logs, events, /metrics or error bodies."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from sqlalchemy.orm import sessionmaker

from deepfleet.controller.client import Client
from deepfleet.controller.db.auth import create_api_token
from deepfleet.controller.db.session import make_engine
from deepfleet.controller.tokens import job_token
from tests.controller.conftest import ADMIN_TOKEN
from tests.controller.e2e_helpers import Controller, wait_phase

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="switching the jobs' user needs a root controller")]
PROBE = [sys.executable, str(Path(__file__).with_name("probe_worker.py"))]
CANARY = "canary-aws-secret-0123456789"
SECRET = "e2e-secret"
ALPHA_UID, BETA_UID = 60001, 60002
# What a job's process may find in its environment: the worker contract, the rendezvous variables,
# its area's HOME/TMPDIR/PYTHONPATH, and the passthrough list.
ALLOWED_ENV = {"DEEPFLEET_WORKER_SPEC", "DEEPFLEET_JOB_ID", "DEEPFLEET_ATTEMPT", "DEEPFLEET_HEARTBEAT_URL",
               "DEEPFLEET_TOKEN", "DEEPFLEET_LOCAL_RUN", "DEEPFLEET_NODE_RANK", "DEEPFLEET_NNODES",
               "DEEPFLEET_MASTER_ADDR", "DEEPFLEET_MASTER_PORT", "DEEPFLEET_RDZV_PORT_FILE", "DF_EXIT_FILE",
               "HOME", "TMPDIR", "PYTHONPATH", "PATH", "LANG", "LC_ALL", "TZ", "OMP_NUM_THREADS", "PWD", "SHLVL", "_"}


@pytest.fixture()
def base() -> Iterator[Path]:
    """A directory other users may enter (pytest's own temporary folders are root-only)."""
    path = Path(tempfile.mkdtemp(prefix="df-iso-", dir="/tmp"))
    os.chmod(path, 0o711)
    yield path
    if not os.environ.get("DF_KEEP"):
        shutil.rmtree(path, ignore_errors=True)


def _job(name: str, project: str, args: list[str]) -> str:
    return yaml.safe_dump({"apiVersion": "deepfleet/v1", "kind": "TrainingJob",
                           "metadata": {"name": name, "project": project},
                           "spec": {"backend": "local", "nodes": 1, "entrypoint": {"script": "probe.py", "args": args},
                                    "checkpoint": {"dir": "ck"}, "env": {"TEAM_NOTE": "visible-to-job"},
                                    "restartPolicy": {"maxRestarts": 0}}})


def _report(data: Path, project: str, job_id: str) -> dict:
    return json.loads((data / "jobs" / project / job_id / "work" / "probe-0.json").read_text())


def _interpreter_runs_as(uid: int) -> bool:
    """Whether an unprivileged user can start this interpreter (a pyenv Python under a 0700 /root cannot)."""
    try:
        return subprocess.run([sys.executable, "-c", "pass"], user=uid, group=uid, extra_groups=[],
                              capture_output=True, timeout=60).returncode == 0
    except PermissionError:
        return False


def test_a_job_sees_only_its_own_environment_user_and_area(base: Path, db_url: str) -> None:
    if not _interpreter_runs_as(ALPHA_UID):
        pytest.skip(f"uid {ALPHA_UID} cannot run {sys.executable}; make the folders above it traversable "
                    "(chmod o+x), as .ci/run does on its throwaway machine")
    data, code = base / "data", base / "code"
    code.mkdir(mode=0o755)
    c = Controller(db_url, data, worker_command=PROBE, workdir=code, replica="iso", extra_env={
        "DEEPFLEET_LOCAL_USER": str(ALPHA_UID), "DEEPFLEET_LOCAL_PROJECT_USERS": f"beta={BETA_UID}",
        "AWS_SECRET_ACCESS_KEY": CANARY})
    try:
        engine = make_engine(db_url)
        with sessionmaker(engine)() as session:
            _, beta_token = create_api_token(session, project="beta", role="member", name="beta", expires_at=None,
                                             created_by="test")
            session.commit()
        engine.dispose()
        beta = Client(c.url, token=beta_token)
        alpha = c.client.submit(_job("train", "test", []))["id"]
        assert wait_phase(c.client, alpha, {"SUCCEEDED", "FAILED"})["phase"] == "SUCCEEDED", c.client.events(alpha)
        again = c.client.submit(_job("train", "test", []))["id"]  # the same name: a new, empty area
        assert wait_phase(c.client, again, {"SUCCEEDED", "FAILED"})["phase"] == "SUCCEEDED"
        a_area = data / "jobs" / "test" / alpha
        targets = [data / "secret", data / "logs", data / "jobs", data / "jobs" / "test",
                   a_area, a_area / "checkpoints", a_area / "work" / "probe-0.json", Path("/root")]
        writes = [data / "evil", a_area / "work" / "evil", code / "evil", data / "jobs" / "test" / "evil"]
        args = [*(x for t in targets for x in ("--read", str(t))), *(x for w in writes for x in ("--write", str(w))),
                "--environ", str(c.proc.pid)]
        attacker = beta.submit(_job("probe", "beta", args))["id"]
        assert wait_phase(beta, attacker, {"SUCCEEDED", "FAILED"})["phase"] == "SUCCEEDED", beta.events(attacker)

        report = _report(data, "beta", attacker)
        env = report["env"]
        assert set(env) <= ALLOWED_ENV, set(env) - ALLOWED_ENV
        assert env["DEEPFLEET_TOKEN"] == job_token(SECRET, attacker)
        assert env["HOME"] == str(data / "jobs" / "beta" / attacker / "work") == report["cwd"]
        assert json.loads(env["DEEPFLEET_WORKER_SPEC"])["env"] == {"TEAM_NOTE": "visible-to-job"}
        assert (report["uid"], report["gid"]) == (BETA_UID, BETA_UID) and report["groups"] in ([], [BETA_UID])
        assert report["sid"] != os.getsid(c.proc.pid)
        assert [k for k, v in {**report["read"], **report["write"], **report["environ"]}.items() if v == "ok"] == []
        assert report["checkpoint_dir"] == str(data / "jobs" / "beta" / attacker / "checkpoints" / "ck")
        first, second = _report(data, "test", alpha), _report(data, "test", again)
        assert first["uid"] == ALPHA_UID and first["checkpoint_dir"] != second["checkpoint_dir"]

        # After the run: every file a job's user owns lies inside that job's own area.
        own = {ALPHA_UID: [a_area, data / "jobs" / "test" / again], BETA_UID: [data / "jobs" / "beta" / attacker]}
        for root, dirs, files in os.walk(base):
            for name in dirs + files:
                path = Path(root) / name
                uid = path.lstat().st_uid
                if uid in own:
                    assert any(path == a or a in path.parents for a in own[uid]), path
        assert not (data / "evil").exists() and not (code / "evil").exists()
        for log in (data / "logs").rglob("node-*.log"):
            assert log.stat().st_mode & 0o077 == 0, log

        # No token or secret in what anyone can read back.
        seen = [c.client.events(j) for j in (alpha, again)] + [beta.events(attacker)]
        seen += [c.client.get(j) for j in (alpha, again)] + [beta.logs(attacker)]
        seen.append(httpx.get(c.url + "/metrics").text)
        seen.append(httpx.get(c.url + "/v1/jobs", headers={"Authorization": "Bearer dft_0123456789ab_wrongwrongwrongwrong"}).text)
        seen.append(httpx.post(c.url + f"/v1/jobs/{alpha}/heartbeat", json={"step": 1},
                               headers={"Authorization": f"Bearer {job_token(SECRET, alpha)}"}).text)
        blob = json.dumps(seen, default=str)
        logs = [p.read_text(errors="replace") for p in data.rglob("*.log")]
        for secret in (ADMIN_TOKEN, SECRET, CANARY, beta_token, *(job_token(SECRET, j) for j in (alpha, again, attacker))):
            assert secret not in blob
            assert not any(secret in text for text in logs), secret
        beta.close()
    finally:
        c.stop()
