"""The Kubernetes backend against the in-process fake API server, through the real `kubernetes` client
loaded from a kubeconfig: submit (idempotent, owner references, the worker token in a Secret), observe (phases, exit codes, failure
classes, the watch resuming after 410), cancel (Background propagation, nothing left), logs, errors."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from deepfleet.controller.backends.base import BackendError, RunPhase
from deepfleet.controller.backends.kubernetes import names
from deepfleet.controller.backends.kubernetes.backend import KubernetesBackend, connect
from deepfleet.controller.backends.kubernetes.watch import PodWatcher
from deepfleet.worker.spec import TOKEN_ENV, FailureClass
from tests.controller.example_jobs import example_submission
from tests.controller.fake_kube import FakeKubeAPI

NS = "default"


@pytest.fixture()
def fake() -> Iterator[FakeKubeAPI]:
    f = FakeKubeAPI().start()
    yield f
    f.stop()


@pytest.fixture()
def backend(fake: FakeKubeAPI, tmp_path) -> Iterator[KubernetesBackend]:
    b = KubernetesBackend(connect(fake.kubeconfig(tmp_path / "kubeconfig")), namespace=NS, watch_timeout_s=2)
    yield b
    b.close()


def wait_for(backend: KubernetesBackend, name: str, phase: RunPhase, *, message: str = "", timeout: float = 10.0):
    """Observe until the run is in `phase` with a message starting with `message` (the pod cache may lag)."""
    deadline = time.monotonic() + timeout
    while True:
        obs = backend.observe(name)
        if (obs.phase is phase and obs.message.startswith(message)) or time.monotonic() > deadline:
            assert obs.phase is phase and obs.message.startswith(message), obs
            return obs
        time.sleep(0.02)


def pods(fake: FakeKubeAPI, run: str) -> list[dict]:
    return sorted(fake.list("pods", NS, f"{names.RUN}={run}"), key=lambda p: p["spec"]["hostname"])


def test_submit_creates_an_indexed_job_and_an_owned_headless_service(fake, backend) -> None:
    sub = example_submission("kubernetes")
    backend.submit(sub)
    job, svc = fake.get("jobs", NS, sub.name), fake.get("services", NS, sub.name)
    assert job is not None and svc is not None
    assert svc["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    posted = [r.path for r in fake.requests if r.method == "POST"]
    assert posted == [f"/apis/batch/v1/namespaces/{NS}/jobs", f"/api/v1/namespaces/{NS}/secrets",
                      f"/api/v1/namespaces/{NS}/services", f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"]
    peers = fake.get("networkpolicies", NS, f"{sub.name}-peers")
    assert peers["spec"]["podSelector"] == {"matchLabels": {names.RUN: sub.name}}
    assert peers["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert fake.requests[0].headers["authorization"] == "Bearer fake-token"
    started = pods(fake, sub.name)
    assert [p["spec"]["hostname"] for p in started] == [f"{sub.name}-0", f"{sub.name}-1"]
    assert {p["spec"]["subdomain"] for p in started} == {sub.name}
    env = [{e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]} for p in started]
    assert [e["JOB_COMPLETION_INDEX"] for e in env] == ["0", "1"]


def test_submit_puts_the_token_in_an_owned_secret_and_not_in_the_job(fake, backend) -> None:
    sub = example_submission("kubernetes")
    token = sub.env[TOKEN_ENV]
    backend.submit(sub)
    job, secret = fake.get("jobs", NS, sub.name), fake.get("secrets", NS, f"{sub.name}-token")
    assert secret is not None and secret["kind"] == "Secret" and secret["type"] == "Opaque"
    assert secret["metadata"]["ownerReferences"] == [{"apiVersion": "batch/v1", "kind": "Job", "name": sub.name,
                                                      "uid": job["metadata"]["uid"], "blockOwnerDeletion": True}]
    assert secret["metadata"]["labels"][names.RUN] == sub.name
    # As stored by the API server: base64 in `data`, the write-only `stringData` gone.
    assert "stringData" not in secret and base64.b64decode(secret["data"][TOKEN_ENV]).decode() == token
    read = backend.core.read_namespaced_secret(f"{sub.name}-token", NS)
    assert base64.b64decode(read.data[TOKEN_ENV]).decode() == token
    assert token not in json.dumps(job)
    for pod in pods(fake, sub.name):
        assert token not in json.dumps(pod)
        (var,) = [e for e in pod["spec"]["containers"][0]["env"] if e["name"] == TOKEN_ENV]
        assert var["valueFrom"]["secretKeyRef"] == {"name": f"{sub.name}-token", "key": TOKEN_ENV}


def test_submit_recovers_a_run_whose_secret_was_never_created(fake, backend) -> None:
    sub = example_submission("kubernetes")
    fake.fail_next("POST", "/secrets$", 503)
    with pytest.raises(BackendError, match=f"create Secret {NS}/{sub.name}-token: HTTP 503") as err:
        backend.submit(sub)
    assert err.value.transient and fake.get("secrets", NS, f"{sub.name}-token") is None
    backend.submit(sub)  # the controller retries: the Job exists (409), the Secret and Service are created now
    uid = fake.get("jobs", NS, sub.name)["metadata"]["uid"]
    assert fake.get("secrets", NS, f"{sub.name}-token")["metadata"]["ownerReferences"][0]["uid"] == uid
    assert fake.get("services", NS, sub.name)["metadata"]["ownerReferences"][0]["uid"] == uid
    fake.fail_next("POST", "/secrets$", 403)
    with pytest.raises(BackendError, match="HTTP 403") as err:
        backend.submit(replace(sub, name="df-other-3f2a9c1e-a1"))
    assert not err.value.transient


def test_submit_is_idempotent(fake, backend) -> None:
    sub = example_submission("kubernetes")
    backend.submit(sub)
    backend.submit(sub)
    assert len(fake.list("jobs", NS)) == 1 and len(fake.list("services", NS)) == 1 and len(pods(fake, sub.name)) == 2
    assert len(fake.list("secrets", NS)) == 1
    assert [r.path.rsplit("/", 1)[-1] for r in fake.calls("GET", "/jobs/")] == [sub.name]  # read back after the 409


def test_submit_recovers_a_run_whose_service_was_never_created(fake, backend) -> None:
    sub = example_submission("kubernetes")
    fake.fail_next("POST", "/services$", 503)
    with pytest.raises(BackendError) as err:
        backend.submit(sub)
    assert err.value.transient and "HTTP 503" in str(err.value)
    backend.submit(sub)  # the controller retries: the Job exists (409), the Service is created now
    assert fake.get("services", NS, sub.name)["metadata"]["ownerReferences"][0]["uid"] == \
        fake.get("jobs", NS, sub.name)["metadata"]["uid"]


def test_a_job_of_the_same_name_from_another_job_is_refused(fake, backend) -> None:
    sub = example_submission("kubernetes")
    backend.submit(sub)
    with pytest.raises(BackendError, match="belongs to job") as err:
        backend.submit(replace(sub, job_id="someone-else"))
    assert not err.value.transient


def test_phases_follow_the_pods(fake, backend) -> None:
    sub = example_submission("kubernetes")
    assert backend.observe(sub.name).phase is RunPhase.NOT_FOUND
    backend.submit(sub)
    first, second = pods(fake, sub.name)
    wait_for(backend, sub.name, RunPhase.PENDING, message="0/2 pods running")
    fake.set_pod_phase(NS, first["metadata"]["name"], "Running")
    wait_for(backend, sub.name, RunPhase.PENDING, message="1/2 pods running")
    fake.set_pod_phase(NS, second["metadata"]["name"], "Running")
    wait_for(backend, sub.name, RunPhase.RUNNING)
    fake.set_pod_phase(NS, second["metadata"]["name"], "Succeeded", exit_code=0)
    wait_for(backend, sub.name, RunPhase.RUNNING)  # a finished node has started too
    fake.set_pod_phase(NS, first["metadata"]["name"], "Succeeded", exit_code=0)
    obs = wait_for(backend, sub.name, RunPhase.SUCCEEDED)
    assert obs.exit_codes == {0: 0, 1: 0} and obs.failure_class is FailureClass.SUCCEEDED


@pytest.mark.parametrize(("code", "reason", "log", "expected"), [
    (137, "OOMKilled", "", FailureClass.OOM),
    (137, "Error", "", FailureClass.NODE_LOST),
    (77, "Error", "", FailureClass.OOM),
    (76, "Error", "", FailureClass.COMM_FAILURE),
    (75, "Error", "", FailureClass.PREEMPTED),
    (65, "Error", "ValueError: bad batch", FailureClass.USER_ERROR),
    (1, "Error", "torch.OutOfMemoryError: CUDA out of memory", FailureClass.OOM),
    (64, "Error", "", FailureClass.INVALID_SPEC),
])
def test_failed_pods_are_classified(fake, backend, code, reason, log, expected) -> None:
    sub = example_submission("kubernetes")
    backend.submit(sub)
    first, second = pods(fake, sub.name)
    fake.set_pod_phase(NS, first["metadata"]["name"], "Running")
    fake.pod_logs[second["metadata"]["name"]] = f"step 1\n{log}\n"
    fake.set_pod_phase(NS, second["metadata"]["name"], "Failed", exit_code=code, reason=reason)
    obs = wait_for(backend, sub.name, RunPhase.FAILED)
    assert obs.failure_class is expected
    assert obs.exit_codes[1] == code and f"node 1 exited {code}" in obs.message
    assert fake.get("jobs", NS, sub.name)["status"]["conditions"][-1]["type"] == "Failed"


def test_cancel_deletes_the_job_with_background_propagation(fake, backend) -> None:
    sub = example_submission("kubernetes")
    backend.submit(sub)
    fake.set_all_pods(NS, sub.name, "Running")
    backend.cancel(sub.name)
    (delete,) = fake.calls("DELETE")
    assert delete.path == f"/apis/batch/v1/namespaces/{NS}/jobs/{sub.name}"
    assert delete.query.get("propagationPolicy") == "Background" or \
        (delete.body or {}).get("propagationPolicy") == "Background"
    assert fake.list("pods", NS) == [] and fake.list("services", NS) == [] and fake.list("jobs", NS) == []
    assert fake.list("secrets", NS) == []
    assert backend.observe(sub.name).phase is RunPhase.NOT_FOUND
    backend.cancel(sub.name)  # idempotent: 404 is success


def test_the_fake_orphans_pods_on_a_job_delete_without_a_policy(fake, backend) -> None:
    """Why cancel must send a policy: a batch/v1 Job delete defaults to Orphan, as on a real API server."""
    sub = example_submission("kubernetes")
    backend.submit(sub)
    backend.batch.delete_namespaced_job(sub.name, NS)
    assert len(pods(fake, sub.name)) == 2 and all(not p["metadata"]["ownerReferences"] for p in pods(fake, sub.name))


def test_watch_resumes_after_410_without_missing_the_terminal_event(fake, backend) -> None:
    sub = example_submission("kubernetes")
    backend.submit(sub)
    watcher = backend.watcher(NS)
    assert watcher.synced.wait(5)
    first, second = pods(fake, sub.name)
    fake.set_all_pods(NS, sub.name, "Running")
    wait_for(backend, sub.name, RunPhase.RUNNING)
    relists = watcher.relists
    with fake.lock:  # while the watch cannot deliver it, the pod fails and the server compacts its history
        fake.set_pod_phase(NS, first["metadata"]["name"], "Failed", exit_code=137, reason="OOMKilled")
        fake.compact()  # ends the open watch; resuming from our version now answers 410 Expired
    deadline = time.monotonic() + 10
    while watcher.relists == relists and time.monotonic() < deadline:
        time.sleep(0.02)
    assert watcher.relists > relists
    cached = {p["metadata"]["name"]: p for p in watcher.pods_of(sub.name, run_label=names.RUN)}
    assert cached[first["metadata"]["name"]]["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] == \
        "OOMKilled"
    assert wait_for(backend, sub.name, RunPhase.FAILED).failure_class is FailureClass.OOM


def test_watcher_resumes_from_its_resource_version(fake, backend) -> None:
    sub = example_submission("kubernetes")
    backend.submit(sub)
    w = PodWatcher(backend.core, NS, selector="app.kubernetes.io/managed-by=deepfleet", timeout_s=1).start()
    try:
        assert w.synced.wait(5)
        for pod in pods(fake, sub.name):
            fake.set_pod_phase(NS, pod["metadata"]["name"], "Running")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(p["status"]["phase"] != "Running" for p in w.pods_of(sub.name, run_label=names.RUN)):
            time.sleep(0.02)
        time.sleep(1.2)  # let at least one watch time out and resume
    finally:
        w.stop()
    watches = [r for r in fake.calls("GET", "/pods") if r.query.get("watch") in ("True", "true")]
    assert len(watches) >= 2 and all(r.query.get("resourceVersion") for r in watches)
    assert int(watches[-1].query["resourceVersion"]) > int(watches[0].query["resourceVersion"])
    assert w.relists == 1 and {p["status"]["phase"] for p in w.pods_of(sub.name, run_label=names.RUN)} == {"Running"}


def test_a_failing_watch_falls_back_to_listing(fake, backend) -> None:
    sub = example_submission("kubernetes")
    backend.submit(sub)
    watcher = backend.watcher(NS)
    assert watcher.synced.wait(5)
    watcher.backoff_s = 30  # stay unsynced for the rest of the test
    fake.fail_next("GET", r"/pods\?.*watch=", 403)
    with fake.lock:  # end the open watch: the next one is refused
        fake.compact()
    deadline = time.monotonic() + 5
    while watcher.synced.is_set() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not watcher.synced.is_set()
    fake.set_all_pods(NS, sub.name, "Running")
    lists = len(fake.calls("GET", "/pods"))
    assert backend.observe(sub.name).phase is RunPhase.RUNNING  # from a direct list, not the stale cache
    assert len(fake.calls("GET", "/pods")) == lists + 1


def test_logs_per_node(fake, backend) -> None:
    sub = example_submission("kubernetes")
    backend.submit(sub)
    first, second = pods(fake, sub.name)
    with pytest.raises(BackendError, match="waiting to start"):  # no log before the container starts
        list(backend.logs(sub.name, node=1))
    fake.pod_logs[second["metadata"]["name"]] = "".join(f"line {i}\n" for i in range(10))
    fake.set_pod_phase(NS, second["metadata"]["name"], "Succeeded", exit_code=0)
    assert list(backend.logs(sub.name, node=1, tail=3)) == ["line 7\n", "line 8\n", "line 9\n"]
    assert len(list(backend.logs(sub.name, node=1))) == 10
    assert list(backend.logs(sub.name, node=1, tail=2, follow=True)) == ["line 8\n", "line 9\n"]
    call = fake.calls("GET", "/log")[-1]
    assert call.path.endswith(f"/pods/{second['metadata']['name']}/log")
    assert call.query["follow"] in ("True", "true") and call.query["tailLines"] == "2" and call.query["container"] == "worker"
    with pytest.raises(BackendError, match="no pod for node 5"):
        list(backend.logs(sub.name, node=5))


def test_following_a_pod_log_streams_until_the_container_ends(fake, backend) -> None:
    sub = example_submission("kubernetes")
    backend.submit(sub)
    pod = pods(fake, sub.name)[0]["metadata"]["name"]
    fake.set_pod_phase(NS, pod, "Running")
    fake.append_pod_log(pod, "step 1\n")
    lines = backend.logs(sub.name, node=0, follow=True)
    assert next(lines) == "step 1\n"
    fake.append_pod_log(pod, "step 2\n")  # written while the client is attached
    assert next(lines) == "step 2\n"
    fake.append_pod_log(pod, "done\n")
    fake.set_pod_phase(NS, pod, "Succeeded", exit_code=0)
    assert list(lines) == ["done\n"]  # the stream ends with the container


def test_errors_become_backend_errors(fake, backend) -> None:
    sub = example_submission("kubernetes")
    fake.fail_next("GET", "/jobs/", 429)
    with pytest.raises(BackendError, match="HTTP 429") as err:
        backend.observe(sub.name)
    assert err.value.transient
    fake.fail_next("POST", "/jobs$", 403)
    with pytest.raises(BackendError, match="HTTP 403") as err:
        backend.submit(sub)
    assert not err.value.transient
    bad_ns = example_submission("kubernetes", kubernetes={"namespace": "missing"})
    with pytest.raises(BackendError, match='namespaces "missing" not found') as err:
        backend.submit(bad_ns)
    assert not err.value.transient


def test_invalid_objects_are_refused_before_any_request(fake, backend) -> None:
    sub = example_submission("kubernetes")
    with pytest.raises(BackendError, match="not a DNS-1123 label") as err:
        backend.submit(replace(sub, name="Not_A_Name"))
    assert not err.value.transient and fake.calls("POST") == []


def test_the_fake_answers_422_for_what_the_api_server_rejects(fake, backend) -> None:
    from kubernetes.client.exceptions import ApiException

    body = {"metadata": {"name": "Bad_Name"}, "spec": {"completionMode": "Indexed",
            "template": {"spec": {"restartPolicy": "Always", "containers": [{"name": "c", "image": "x"}]}}}}
    with pytest.raises(ApiException) as err:
        backend.batch.create_namespaced_job(NS, body)
    assert err.value.status == 422 and "DNS-1123" in err.value.body and "completions" in err.value.body
    secret = {"metadata": {"name": "s"}, "data": {"bad key": "not base64!"}}
    with pytest.raises(ApiException) as err:
        backend.core.create_namespaced_secret(NS, secret)
    assert err.value.status == 422 and "not base64" in err.value.body and "config key" in err.value.body


def test_unreachable_api_server_is_transient(tmp_path) -> None:
    fake = FakeKubeAPI().start()
    kubeconfig = fake.kubeconfig(tmp_path / "kubeconfig")
    fake.stop()
    client = connect(kubeconfig)
    client.configuration.retries = 0
    b = KubernetesBackend(client, namespace=NS)
    with pytest.raises(BackendError, match="cannot reach the API server") as err:
        b.observe("df-x-00000000-a1")
    assert err.value.transient
    b.close()


def test_missing_kubeconfig_is_a_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(BackendError, match="cannot load cluster credentials"):
        connect(str(tmp_path / "nope"))
