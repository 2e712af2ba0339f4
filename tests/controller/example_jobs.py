"""The example job (`examples/gpt/job.yaml`) switched to the Kubernetes or Azure ML backend, compiled into
the Submission a backend receives; shared by the backend tests and the rendezvous conformance test. Also
the example ServingJob (`examples/gpt/serve.yaml`) naming a trained job, for the serving tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from deepfleet.controller.backends.base import Submission
from deepfleet.controller.compile import compile_submission
from deepfleet.controller.sources import CheckpointSource
from deepfleet.controller.spec import validate_job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt"
SERVE_EXAMPLE = EXAMPLE / "serve.yaml"
TRAINED = "0123456789abcdef0123456789abcdef"  # the id of the training job a serving example names
IMAGE = "registry.example.com/deepfleet-worker:0.1"
JOB_ID = "3f2a9c1e7b5d4e60a1b2c3d4e5f60718"
K8S_OPTIONS = {
    "namespace": "default",
    "nodeSelector": {"pool": "gpu"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "priorityClassName": "training",
    "serviceAccountName": "deepfleet-worker",
    "imagePullSecrets": ["regcred"],
    "shmSize": "2Gi",
    "terminationGracePeriodSeconds": 120,
}


def example_document(backend: str, **spec_overrides: Any) -> dict[str, Any]:
    """examples/gpt/job.yaml with the engine inline (as the CLI sends it) and `backend` switched."""
    doc = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    spec = doc["spec"]
    spec["engine"] = json.loads((EXAMPLE / spec["engine"]).read_text())
    # The tests change nodes/processesPerNode; let the engine derive the global batch from the world size.
    spec["engine"].pop("train_batch_size", None)
    spec["backend"] = backend
    spec["image"] = IMAGE
    if backend == "kubernetes":
        spec["kubernetes"] = dict(K8S_OPTIONS)
        spec["resources"] = {"cpu": "4", "memory": "16Gi", "gpu": 1, "gpuType": "NVIDIA-H100-80GB-HBM3"}
    if backend == "azureml":
        spec["azureml"] = {"compute": "gpu-cluster", "experimentName": "gpt-experiments"}
    spec.update(spec_overrides)
    return doc


def example_submission(backend: str, *, attempt: int = 1, job_id: str = JOB_ID, **spec_overrides: Any) -> Submission:
    spec = validate_job(example_document(backend, **spec_overrides))
    return compile_submission(spec, job_id=job_id, attempt=attempt, controller_url="http://deepfleet.ns.svc:8000",
                              secret="test-secret")


def serving_document(**spec_overrides: Any) -> dict[str, Any]:
    """examples/gpt/serve.yaml naming the job TRAINED, with `spec_overrides` applied."""
    doc = yaml.safe_load(SERVE_EXAMPLE.read_text())
    doc["spec"]["model"]["job"] = TRAINED
    doc["spec"].update(spec_overrides)
    return doc


def serving_submission(doc: dict[str, Any], source: CheckpointSource | None = None) -> Submission:
    """Attempt 0 of a serving document, with `source` as the stored record of the job it serves."""
    return compile_submission(validate_job(doc), job_id=JOB_ID, attempt=0, controller_url="http://ctl:8000",
                              secret="test-secret", checkpoint_source=source)
