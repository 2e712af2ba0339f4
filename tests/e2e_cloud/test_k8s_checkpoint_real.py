"""Opt-in: another job's checkpoint on a real cluster. Run with

    DEEPFLEET_E2E_KUBECONFIG=~/.kube/config DEEPFLEET_E2E_IMAGE=<worker image the cluster can pull> \
    DEEPFLEET_E2E_CLAIM=<ReadWriteMany PersistentVolumeClaim in the namespace> \
        pytest -m k8s tests/e2e_cloud/test_k8s_checkpoint_real.py

Optional: DEEPFLEET_E2E_NAMESPACE (default "default"). The example job trains 40 steps with its
checkpoints on the claim (its own directory `<project>/<job id>`); a second training job names it in
`checkpoint.resumeFrom`, mounts that directory read-only, starts at step 40 from a copy in its own
directory and trains to 50; a ServingJob names the first in `model.job`, mounts the same directory
read-only and loads the newest complete checkpoint there (its log says it serves it). This checks what
the fake API server cannot: the kubelet mounting a claim's subPath read-only, the pods reading it, and
the storage's real permissions.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest

from deepfleet.controller.backends.base import RunPhase, Submission
from deepfleet.controller.backends.kubernetes import manifests
from deepfleet.controller.backends.kubernetes.backend import KubernetesBackend, connect
from deepfleet.controller.compile import compile_submission
from deepfleet.controller.sources import checkpoint_source
from deepfleet.controller.spec import validate_job
from tests.controller.example_jobs import example_document, serving_document
from tests.e2e_cloud.test_k8s_real import NAMESPACE, wait

ENV = ("DEEPFLEET_E2E_KUBECONFIG", "DEEPFLEET_E2E_IMAGE", "DEEPFLEET_E2E_CLAIM")
pytestmark = [pytest.mark.k8s,
              pytest.mark.skipif(not all(os.environ.get(k) for k in ENV),
                                 reason=f"set {', '.join(ENV)} to run against a real cluster")]
OPTIONS = {"namespace": NAMESPACE, "shmSize": "256Mi", "terminationGracePeriodSeconds": 30}
ENV_VARS = {"OMP_NUM_THREADS": "1", "PYTHONPATH": "/opt/deepfleet"}


@pytest.fixture()
def backend() -> Iterator[KubernetesBackend]:
    b = KubernetesBackend(connect(os.path.expanduser(os.environ["DEEPFLEET_E2E_KUBECONFIG"])), namespace=NAMESPACE)
    yield b
    b.close()


def _compile(doc: dict, source: Submission | None = None) -> Submission:
    spec = validate_job(doc)
    where = None if source is None else checkpoint_source(source.job_id, project=source.spec.metadata.project,
                                                          backend="kubernetes", document=source.spec.to_document())
    return compile_submission(spec, job_id=uuid.uuid4().hex, attempt=0, controller_url="http://deepfleet.ns.svc:8000",
                              secret="e2e", checkpoint_source=where)


def _training(**overrides) -> dict:
    return example_document("kubernetes", image=os.environ["DEEPFLEET_E2E_IMAGE"],
                            resources={"cpu": "1", "memory": "2Gi"}, env=ENV_VARS,
                            kubernetes={**OPTIONS, "checkpointClaim": os.environ["DEEPFLEET_E2E_CLAIM"]}, **overrides)


def _finish(backend, sub: Submission, *, timeout: float = 900) -> str:
    backend.submit(sub)
    try:
        obs = wait(backend, sub.name, {RunPhase.SUCCEEDED, RunPhase.FAILED}, timeout=timeout)
        log = "".join(backend.logs(sub.name, node=0, tail=400))
        assert obs.phase is RunPhase.SUCCEEDED, f"{obs.message}\n{log}"
        return log
    finally:
        backend.cancel(sub.name)


def test_a_job_resumes_and_a_serving_job_serves_another_jobs_checkpoint(backend) -> None:
    trained = _compile(_training(checkpoint={"dir": "/checkpoints/e2e", "everySteps": 10}))
    _finish(backend, trained)

    resumed = _compile(_training(maxSteps=50, checkpoint={"dir": "/checkpoints/e2e", "resumeFrom": trained.job_id}),
                       trained)
    log = _finish(backend, resumed)
    assert "starting at step 40/50 from checkpoint global_step40" in log, log

    doc = serving_document(backend="kubernetes", image=os.environ["DEEPFLEET_E2E_IMAGE"],
                           resources={"cpu": "1", "memory": "2Gi"}, kubernetes=OPTIONS, env=ENV_VARS)
    doc["spec"]["model"] = {"job": trained.job_id, "factory": "examples.gpt.factories:build",
                            "args": {"num_samples": 4096}}
    served = _compile(doc, trained)
    backend.submit(served)
    try:
        wait(backend, served.name, {RunPhase.RUNNING}, timeout=600)
        deadline, log = time.monotonic() + 300, ""
        while f"serving {manifests.SOURCE_MOUNT} at" not in log:
            assert time.monotonic() < deadline, log
            time.sleep(5)
            log = "".join(backend.logs(served.name, node=0, tail=100))
        assert backend.observe(served.name).phase is RunPhase.RUNNING  # loaded and listening, nothing written
    finally:
        backend.cancel(served.name)
