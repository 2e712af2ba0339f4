"""Opt-in: the Kubernetes backend against a real cluster (kind, AKS, ...). Run with

    DEEPFLEET_E2E_KUBECONFIG=~/.kube/config DEEPFLEET_E2E_IMAGE=<worker image the cluster can pull> \
        pytest -m k8s tests/e2e_cloud/test_k8s_real.py

Optional: DEEPFLEET_E2E_NAMESPACE (default "default"). The example job (examples/gpt/job.yaml, two CPU
nodes) runs as an Indexed Job: the pods find node 0 through the headless Service's DNS name, train to
the end and the run is observed SUCCEEDED; a second run is cancelled while it runs and no pod of it may
remain. This checks what the fake API server cannot: scheduling, DNS, the c10d rendezvous across pods,
the Job controller's real timing and garbage collection.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest

from deepfleet.controller.backends.base import RunPhase
from deepfleet.controller.backends.kubernetes import names
from deepfleet.controller.backends.kubernetes.backend import KubernetesBackend, connect
from tests.controller.example_jobs import example_submission

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.skipif(not os.environ.get("DEEPFLEET_E2E_KUBECONFIG") or not os.environ.get("DEEPFLEET_E2E_IMAGE"),
                       reason="set DEEPFLEET_E2E_KUBECONFIG and DEEPFLEET_E2E_IMAGE to run against a real cluster"),
]
NAMESPACE = os.environ.get("DEEPFLEET_E2E_NAMESPACE", "default")


@pytest.fixture()
def backend() -> Iterator[KubernetesBackend]:
    b = KubernetesBackend(connect(os.path.expanduser(os.environ["DEEPFLEET_E2E_KUBECONFIG"])), namespace=NAMESPACE)
    yield b
    b.close()


def submission(**overrides):
    return example_submission(
        "kubernetes", job_id=uuid.uuid4().hex, image=os.environ["DEEPFLEET_E2E_IMAGE"],
        resources={"cpu": "1", "memory": "2Gi"},
        kubernetes={"namespace": NAMESPACE, "shmSize": "256Mi", "terminationGracePeriodSeconds": 30},
        checkpoint={"dir": "/tmp/deepfleet-e2e", "everySteps": 10},
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": "/opt/deepfleet"}, **overrides)


def wait(backend: KubernetesBackend, name: str, phases: set[RunPhase], *, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        obs = backend.observe(name)
        if obs.phase in phases:
            return obs
        assert time.monotonic() < deadline, f"{name} still {obs.phase}: {obs.message}"
        time.sleep(5)


def test_the_example_job_trains_to_the_end(backend: KubernetesBackend) -> None:
    sub = submission()
    backend.submit(sub)
    try:
        obs = wait(backend, sub.name, {RunPhase.SUCCEEDED, RunPhase.FAILED}, timeout=900)
        log = "".join(backend.logs(sub.name, node=0, tail=200))
        assert obs.phase is RunPhase.SUCCEEDED, f"{obs.message}\n{log}"
        assert obs.exit_codes == {0: 0, 1: 0}
    finally:
        backend.cancel(sub.name)


def test_cancel_removes_every_pod(backend: KubernetesBackend) -> None:
    sub = submission()
    backend.submit(sub)
    try:
        wait(backend, sub.name, {RunPhase.RUNNING}, timeout=600)
    finally:
        backend.cancel(sub.name)
    deadline = time.monotonic() + 120
    while backend.core.list_namespaced_pod(NAMESPACE, label_selector=f"{names.RUN}={sub.name}").items:
        assert time.monotonic() < deadline, "pods of the cancelled run remain"
        time.sleep(2)
    assert backend.observe(sub.name).phase is RunPhase.NOT_FOUND
