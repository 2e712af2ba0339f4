"""The ServingJob kind without processes: the example spec parses and compiles into the worker contract
(the factory as the entrypoint, the named job as the checkpoint to copy, `serve` set); bad specs fail with
one line naming the field; the Kubernetes manifests and the Azure ML command job of a serving attempt are
rendered by the same code as a training job's and pass the same upstream schemas; on the API (PostgreSQL)
a bad spec is a 422 naming the field, and a checkpoint of another project, an unfinished job or a
serving job is refused."""

from __future__ import annotations

import copy
import json
import warnings
from typing import Any

import kubernetes_validate
import pytest
import yaml

from deepfleet.controller.backends.kubernetes import manifests
from deepfleet.controller.db.models import Job
from deepfleet.controller.sources import CheckpointSource
from deepfleet.controller.spec import (
    SERVED_CHECKPOINT_DIR,
    ServingJob,
    SpecError,
    parse_job_yaml,
    validate_job,
)
from deepfleet.worker.spec import FactoryEntrypoint, WorkerSpec
from tests.controller.api.helpers import job_yaml, token, yaml_headers
from tests.controller.example_jobs import IMAGE, SERVE_EXAMPLE, TRAINED, serving_document
from tests.controller.example_jobs import serving_submission as compiled

EXAMPLE = SERVE_EXAMPLE


def test_the_example_compiles_into_a_serving_worker_spec() -> None:
    spec = parse_job_yaml(EXAMPLE.read_text())
    assert isinstance(spec, ServingJob) and spec.spec.max_out_tokens == 64
    sub = compiled(serving_document(quant={"numBits": 4, "groupSize": 32}, dtype="bf16", compile=True))
    ws = sub.worker_spec
    assert ws.serve is not None and ws.serve.dtype == "bf16" and ws.serve.quant.num_bits == 4 and ws.serve.compile
    assert ws.serve.quant.group_size == 32 and ws.serve.max_out_tokens == 64 and ws.serve.max_batch_size == 16
    assert ws.entrypoint == FactoryEntrypoint(factory="examples.gpt.factories:build", args={"num_samples": 8})
    assert ws.checkpoint.dir == SERVED_CHECKPOINT_DIR and ws.checkpoint.resume_from == TRAINED
    assert ws.nodes.max == 1 and ws.processes_per_node == 1 and ws.max_steps is None
    # What the worker reads from its environment is the same contract (round trip through the JSON).
    assert WorkerSpec.model_validate_json(sub.env["DEEPFLEET_WORKER_SPEC"]).serve == ws.serve
    # The stored document is the user's, without the derived training fields.
    assert set(validate_job(serving_document()).to_document()["spec"]) >= {"model", "dtype", "maxOutTokens"}
    assert "entrypoint" not in validate_job(serving_document()).to_document()["spec"]


BAD = [
    ({"dtype": "int3"}, "spec.dtype: "),
    ({"quant": {"numBits": 5}}, "spec.quant.numBits: "),
    ({"maxOutTokens": 1}, "spec.maxOutTokens: "),
    ({"maxBatchSize": 0}, "spec.maxBatchSize: "),
    ({"entrypoint": {"script": "x.py"}}, "spec.entrypoint: unknown field"),
    ({"checkpoint": {"dir": "/etc"}}, "spec.checkpoint: unknown field"),
    ({"env": {"DEEPFLEET_TOKEN": "x"}}, "spec.env: "),
    ({"backend": "kubernetes"}, "spec.image: required for backend kubernetes"),
    ({"backend": "azureml", "image": IMAGE}, "spec.azureml: required for backend azureml"),
]


@pytest.mark.parametrize(("override", "line"), BAD, ids=[b[1].split(":")[0] + str(i) for i, b in enumerate(BAD)])
def test_a_bad_serving_spec_gets_one_line_naming_the_field(override: dict, line: str) -> None:
    with pytest.raises(SpecError) as e:
        validate_job(serving_document(**override))
    assert len(e.value.errors) == 1 and e.value.errors[0].startswith(line), e.value.errors


@pytest.mark.parametrize(("model", "line"), [
    ({"job": "../../other/abc", "factory": "examples.gpt.factories:build"}, "spec.model.job: "),
    ({"job": "/srv/ck", "factory": "examples.gpt.factories:build"}, "spec.model.job: "),
    ({"job": TRAINED, "factory": "examples.gpt.factories"}, "spec.model.factory: "),
    ({"factory": "examples.gpt.factories:build"}, "spec.model.job: required field is missing"),
])
def test_the_checkpoint_is_named_by_job_never_by_path(model: dict, line: str) -> None:
    doc = serving_document()
    doc["spec"]["model"] = model
    with pytest.raises(SpecError) as e:
        validate_job(doc)
    assert len(e.value.errors) == 1 and e.value.errors[0].startswith(line), e.value.errors


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_kubernetes_manifests_of_a_serving_attempt_pass_the_upstream_schemas(version: str) -> None:
    source = CheckpointSource(job_id=TRAINED, project="default", backend="kubernetes", dir="/ck", claim="ckpt")
    sub = compiled(serving_document(backend="kubernetes", image=IMAGE, resources={"cpu": "2", "memory": "4Gi"}),
                   source)
    objects = manifests.render(sub, namespace="default", job_uid="5b7d7c52-0000-4000-8000-000000000001")
    assert [o["kind"] for o in objects] == ["Job", "Secret", "Service"]
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)
    job, _, service = objects
    assert job["spec"]["completions"] == 1
    (container,) = job["spec"]["template"]["spec"]["containers"]
    worker = json.loads(next(e["value"] for e in container["env"] if e["name"] == "DEEPFLEET_WORKER_SPEC"))
    assert worker["serve"]["max_out_tokens"] == 64 and worker["checkpoint"]["resume_from"] == TRAINED
    assert worker["checkpoint"]["dir"] == manifests.SOURCE_MOUNT  # the trained job's claim, mounted read-only
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in container["ports"]
    assert any(p["name"] == "http" and p["port"] == 8000 for p in service["spec"]["ports"])


def test_an_azureml_serving_job_is_one_command_job_instance() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from deepfleet.controller.backends.azureml import AzureMLBackend, connect
        from tests.controller.fake_azureml import SUBSCRIPTION, FakeAzureML, FakeCredential

        fake = FakeAzureML()
        backend = AzureMLBackend(connect(SUBSCRIPTION, "rg", "ws", credential=FakeCredential(), transport=fake,
                                         retry_total=0))
        source = CheckpointSource(job_id=TRAINED, project="default", backend="azureml", dir="ck")
        sub = compiled(serving_document(backend="azureml", image=IMAGE, azureml={"compute": "cpu-cluster"}), source)
        backend.submit(sub)
    (put,) = fake.job_puts()
    props = put.body["properties"]
    assert props["jobType"] == "Command" and props["resources"]["instanceCount"] == 1
    worker = json.loads(props["environmentVariables"]["DEEPFLEET_WORKER_SPEC"])
    assert worker["serve"]["max_out_tokens"] == 64 and worker["checkpoint"]["resume_from"] == TRAINED
    assert props["command"] == "deepfleet-worker --checkpoint-dir ${{inputs.checkpoint}}"  # the trained job's folder


# ------------------------------------------------------------------------------------------ the API
def _serving_yaml(job_id: str, project: str = "research", **spec: Any) -> str:
    doc = serving_document(**spec)
    doc["metadata"]["project"] = project
    doc["spec"]["model"]["job"] = job_id
    return yaml.safe_dump(doc)


def _finish(app, job_id: str) -> None:
    with app.state.sessions() as session:
        session.get(Job, job_id).phase = "SUCCEEDED"
        session.commit()


def test_the_api_refuses_bad_serving_specs_and_other_projects_checkpoints(client, app) -> None:
    member = yaml_headers(token(app, project="research", role="member"))
    vision = yaml_headers(token(app, project="vision", role="member"))
    own = client.post("/v1/jobs", content=job_yaml(), headers=member).json()["id"]
    other = client.post("/v1/jobs", content=job_yaml(project="vision"), headers=vision).json()["id"]
    _finish(app, own)
    _finish(app, other)

    r = client.post("/v1/jobs", content=_serving_yaml(own, dtype="int3"), headers=member)
    assert r.status_code == 422 and len(r.json()["errors"]) == 1 and r.json()["errors"][0].startswith("spec.dtype: ")
    r = client.post("/v1/jobs", content=_serving_yaml(other), headers=member)
    assert r.status_code == 422
    assert r.json()["errors"] == [f"spec.model.job: no job {other!r} in project 'research'; name a job of this project"]
    unfinished = client.post("/v1/jobs", content=job_yaml(name="running"), headers=member).json()["id"]
    r = client.post("/v1/jobs", content=_serving_yaml(unfinished), headers=member)
    assert r.status_code == 422 and r.json()["errors"][0].startswith(f"spec.model.job: job {unfinished!r} is a "
                                                                    "TrainingJob in phase PENDING")

    r = client.post("/v1/jobs", content=_serving_yaml(own), headers=member)
    assert r.status_code == 201, r.text
    served = r.json()
    assert served["spec"]["kind"] == "ServingJob" and served["world_size"] == 1 and served["endpoint"] is None
    doc = copy.deepcopy(served["spec"])
    assert doc["spec"]["model"]["job"] == own
    r = client.post("/v1/jobs", content=_serving_yaml(served["id"]), headers=member)  # a serving job is no checkpoint
    assert r.status_code == 422 and "is a ServingJob" in r.json()["errors"][0]


def test_a_serving_job_takes_its_api_key_from_a_secret() -> None:
    """DEEPFLEET_SERVE_API_KEY carries deepfleet's prefix yet is the user's to set (the endpoint's key),
    as a secret reference: the stored spec and the compiled submission hold only the secret's name."""
    from deepfleet.controller.spec import SecretRef, secret_refs

    doc = serving_document(env={"DEEPFLEET_SERVE_API_KEY": {"secret": "serve-key"}})
    spec = validate_job(doc)
    assert secret_refs(spec) == {"DEEPFLEET_SERVE_API_KEY": SecretRef(secret="serve-key")}
    sub = compiled(doc)
    assert "DEEPFLEET_SERVE_API_KEY" not in sub.env  # resolved by the backend at launch, never in the spec text
