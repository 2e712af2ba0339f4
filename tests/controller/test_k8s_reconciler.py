"""The real reconciler driving the Kubernetes backend against the fake API server (SQLite database):
submit -> pods -> Running -> Succeeded -> job SUCCEEDED; a pod killed (exit 137) -> node loss and a new
attempt whose Job replaces the old one; OOMKilled -> the job fails as out of memory; cancel -> the Job
and its pods are gone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
from sqlalchemy import select

from deepfleet.controller.backends.kubernetes import names
from deepfleet.controller.backends.kubernetes.backend import KubernetesBackend, connect
from deepfleet.controller.db.models import Attempt, Job
from deepfleet.controller.reconciler import Reconciler, ReconcilerConfig
from tests.controller.example_jobs import example_document
from tests.controller.fake_kube import FakeKubeAPI
from tests.controller.reconcile_helpers import database, events, insert_job

NS = "default"


@pytest.fixture()
def fake() -> Iterator[FakeKubeAPI]:
    f = FakeKubeAPI().start()
    yield f
    f.stop()


@pytest.fixture()
def setup(fake, tmp_path):
    backend = KubernetesBackend(connect(fake.kubeconfig(tmp_path / "kubeconfig")), namespace=NS, watch_timeout_s=2)
    sessions = database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    config = ReconcilerConfig(replica_id="r1", controller_url="http://deepfleet.ns.svc:8000", secret="s",
                              backend_name="kubernetes")
    doc = example_document("kubernetes", restartPolicy={"maxRestarts": 3, "backoffSeconds": 0})
    doc["metadata"]["project"] = "test"
    job_id = insert_job(sessions, doc)
    yield Reconciler(sessions, backend=backend, config=config), sessions, job_id
    backend.close()


def until(rec: Reconciler, sessions, job_id: str, check, *, timeout: float = 15.0) -> Job:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec.reconcile_once(datetime.now(timezone.utc))
        with sessions() as s:
            job = s.get(Job, job_id)
            if check(job):
                return job
        time.sleep(0.05)
    raise AssertionError(f"condition never met: {job.phase} {job.message} {events(sessions, job_id)}")


def run_pods(fake: FakeKubeAPI, job_id: str, attempt: int) -> list[dict]:
    selector = f"{names.JOB_ID}={job_id},{names.ATTEMPT}={attempt}"
    return sorted(fake.list("pods", NS, selector), key=lambda p: p["spec"]["hostname"])


def attempts(sessions, job_id: str) -> list[Attempt]:
    with sessions() as s:
        return list(s.scalars(select(Attempt).where(Attempt.job_id == job_id).order_by(Attempt.number)))


def test_a_job_runs_to_success(fake, setup) -> None:
    rec, sessions, job_id = setup
    job = until(rec, sessions, job_id, lambda j: len(run_pods(fake, job_id, j.current_attempt)) == 2)
    for pod in run_pods(fake, job_id, job.current_attempt):
        fake.set_pod_phase(NS, pod["metadata"]["name"], "Running")
    until(rec, sessions, job_id, lambda j: j.phase == "RUNNING")
    for pod in run_pods(fake, job_id, job.current_attempt):
        fake.set_pod_phase(NS, pod["metadata"]["name"], "Succeeded", exit_code=0)
    until(rec, sessions, job_id, lambda j: j.phase == "SUCCEEDED")
    (attempt,) = attempts(sessions, job_id)
    assert attempt.backend == "kubernetes" and attempt.exit_codes == {"0": 0, "1": 0}
    assert fake.get("jobs", NS, attempt.run_name) is not None  # a finished run's pods keep their logs


def test_a_killed_pod_starts_a_new_attempt(fake, setup) -> None:
    rec, sessions, job_id = setup
    job = until(rec, sessions, job_id, lambda j: len(run_pods(fake, job_id, j.current_attempt)) == 2)
    first = job.current_attempt
    pods = run_pods(fake, job_id, first)
    for pod in pods:
        fake.set_pod_phase(NS, pod["metadata"]["name"], "Running")
    until(rec, sessions, job_id, lambda j: j.phase == "RUNNING")
    fake.set_pod_phase(NS, pods[1]["metadata"]["name"], "Failed", exit_code=137, reason="Error")
    job = until(rec, sessions, job_id, lambda j: j.current_attempt == first + 1
                and len(run_pods(fake, job_id, first + 1)) == 2)
    old = attempts(sessions, job_id)[0]
    assert old.failure_class == "node_lost" and old.exit_codes["1"] == 137
    assert fake.get("jobs", NS, old.run_name) is None and run_pods(fake, job_id, first) == []
    delete = fake.calls("DELETE", f"/jobs/{old.run_name}")[0]
    assert delete.query["propagationPolicy"] == "Background"
    assert job.restart_counts == {"node_lost": 1}


def test_oom_killed_fails_the_job_as_out_of_memory(fake, setup) -> None:
    rec, sessions, job_id = setup
    job = until(rec, sessions, job_id, lambda j: len(run_pods(fake, job_id, j.current_attempt)) == 2)
    pod = run_pods(fake, job_id, job.current_attempt)[0]
    fake.set_pod_phase(NS, pod["metadata"]["name"], "Failed", exit_code=137, reason="OOMKilled")
    job = until(rec, sessions, job_id, lambda j: j.phase == "FAILED")
    assert "out of memory" in job.message
    assert attempts(sessions, job_id)[-1].failure_class == "oom"


def test_cancel_removes_the_job_and_its_pods(fake, setup) -> None:
    rec, sessions, job_id = setup
    job = until(rec, sessions, job_id, lambda j: len(run_pods(fake, job_id, j.current_attempt)) == 2)
    for pod in run_pods(fake, job_id, job.current_attempt):
        fake.set_pod_phase(NS, pod["metadata"]["name"], "Running")
    until(rec, sessions, job_id, lambda j: j.phase == "RUNNING")
    with sessions() as s, s.begin():
        s.get(Job, job_id).desired_state = "cancel_requested"
    until(rec, sessions, job_id, lambda j: j.phase == "CANCELLED")
    assert fake.list("jobs", NS) == [] and fake.list("pods", NS) == [] and fake.list("services", NS) == []
    assert fake.list("secrets", NS) == []
    assert all(c.query.get("propagationPolicy") == "Background" for c in fake.calls("DELETE"))


def test_the_api_serves_pod_logs_per_node_through_the_backend(fake, setup, tmp_path) -> None:
    from deepfleet.controller.app import create_app
    from deepfleet.controller.server import backend_log_reader
    from deepfleet.controller.settings import Settings
    from tests.controller.conftest import ADMIN_TOKEN, TestClient

    rec, sessions, job_id = setup
    job = until(rec, sessions, job_id, lambda j: len(run_pods(fake, job_id, j.current_attempt)) == 2)
    for i, pod in enumerate(run_pods(fake, job_id, job.current_attempt)):
        fake.set_pod_phase(NS, pod["metadata"]["name"], "Running")
        fake.append_pod_log(pod["metadata"]["name"], f"node {i} step 1\n")
    settings = Settings(data_dir=tmp_path, database_url=f"sqlite:///{tmp_path / 'db.sqlite'}", migrate_on_start=False,
                        secret="s", admin_token=ADMIN_TOKEN, admin_project="test")
    app = create_app(settings, log_reader=backend_log_reader({"kubernetes": rec.backend}))
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with TestClient(app) as client:
        assert client.get(f"/v1/jobs/{job_id}/logs", params={"node": 1}, headers=auth).text == "node 1 step 1\n"
        missing = client.get(f"/v1/jobs/{job_id}/logs", params={"node": 7}, headers=auth)
        assert missing.status_code == 404 and "no pod for node 7" in missing.json()["detail"]
        for pod in run_pods(fake, job_id, job.current_attempt):
            fake.append_pod_log(pod["metadata"]["name"], "done\n")
            fake.set_pod_phase(NS, pod["metadata"]["name"], "Succeeded", exit_code=0)
        followed = client.get(f"/v1/jobs/{job_id}/logs", params={"follow": "true"}, headers=auth)
        assert followed.text == "node 0 step 1\ndone\n"
    # a run on a backend this controller does not serve says so
    app = create_app(settings, log_reader=backend_log_reader({}))
    with TestClient(app) as client:
        other = client.get(f"/v1/jobs/{job_id}/logs", headers=auth)
        assert other.status_code == 404 and "enable it in DEEPFLEET_BACKENDS" in other.json()["detail"]
