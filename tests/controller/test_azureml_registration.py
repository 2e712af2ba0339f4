"""`spec.registerModel` on Azure ML, through the real `MLClient` and the fake ARM transport: the command job
exports into a model output, and when the job completes the reconciler registers that output's file as a
workspace model asset (`ml_client.models.create_or_update(Model(...))`), with the exact requests checked:
once per job (a lost commit adopts the version tagged with the job), the next version for the next job,
and an ARM refusal recorded on the job, which stays SUCCEEDED."""

from __future__ import annotations

import json
import warnings
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from deepfleet.controller.db.models import Job
from deepfleet.controller.reconciler import Reconciler, ReconcilerConfig
from tests.controller.example_jobs import example_document, example_submission
from tests.controller.fake_azureml import SUBSCRIPTION, FakeAzureML, FakeCredential
from tests.controller.reconcile_helpers import database, events, insert_job, job

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning:azure")]

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from deepfleet.controller.backends.azureml import AzureMLBackend, connect

WORKSPACE = f"/subscriptions/{SUBSCRIPTION}/resourceGroups/rg/providers/Microsoft.MachineLearningServices/workspaces/ws"
MODELS = f"{WORKSPACE}/models/gpt-small"


@pytest.fixture()
def fake() -> FakeAzureML:
    return FakeAzureML()


@pytest.fixture()
def backend(fake: FakeAzureML) -> AzureMLBackend:
    return AzureMLBackend(connect(SUBSCRIPTION, "rg", "ws", credential=FakeCredential(), transport=fake,
                                  retry_total=0))


def test_a_job_that_registers_its_model_exports_into_a_model_output(fake, backend) -> None:
    sub = example_submission("azureml", registerModel={"name": "gpt-small", "dtype": "bf16"})
    backend.submit(sub)
    props = fake.job_puts()[0].body["properties"]
    assert props["command"] == "deepfleet-worker --export-dir ${{outputs.model}}"
    assert props["outputs"] == {"model": {"jobOutputType": "uri_folder", "mode": "ReadWriteMount"}}
    worker = json.loads(props["environmentVariables"]["DEEPFLEET_WORKER_SPEC"])
    assert worker["export"] == {"dtype": "bf16"}
    plain = example_submission("azureml", job_id="0" * 32)
    backend.submit(plain)
    assert fake.job_puts()[1].body["properties"]["command"] == "deepfleet-worker"  # no export, no output
    assert not fake.job_puts()[1].body["properties"].get("outputs")


def _succeed(rec: Reconciler, fake: FakeAzureML, sessions, job_id: str, now: datetime) -> Job:
    rec.reconcile_once(now)  # admit
    rec.reconcile_once(now)  # submit
    with sessions() as s:
        run = s.get(Job, job_id).attempts[0].run_name
    fake.set_status(run, "Completed")
    rec.reconcile_once(now)  # SUCCEEDED, then the registrar's try in the same pass
    return job(sessions, job_id)


def test_a_completed_job_is_registered_as_a_workspace_model_asset(fake, backend, tmp_path: Path) -> None:
    sessions = database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    config = ReconcilerConfig(replica_id="r1", controller_url="https://deepfleet.example.com", secret="s",
                              backend_name="azureml")
    rec = Reconciler(sessions, backend=backend, config=config, registry=backend.model_registry())
    doc = example_document("azureml", registerModel={"name": "gpt-small"})
    doc["metadata"]["project"] = "test"
    job_id = insert_job(sessions, doc)
    now = datetime.now(timezone.utc)
    done = _succeed(rec, fake, sessions, job_id, now)
    assert done.phase == "SUCCEEDED" and done.registration_state == "registered", done.registration
    assert done.registration["uri"] == "azureml:gpt-small:1" and done.registration["registry"] == "azureml"
    run = done.registration["source"].split("/")[3]
    assert done.registration["source"] == f"azureml://jobs/{run}/outputs/model/paths/model.safetensors"
    assert events(sessions, job_id)[-1] == "ModelRegistered"

    model_calls = [(c.method, c.path, c.query) for c in fake.calls if "/models/" in c.path]
    assert model_calls == [
        # ours: is a version of this job there already (archived ones count as gone)?
        ("GET", f"{MODELS}/versions", "api-version=2023-08-01-preview&listViewType=ActiveOnly"),
        ("GET", f"{MODELS}/versions", "api-version=2023-08-01-preview&$orderBy=createdtime%20desc&$top=1"),
        ("GET", MODELS, "api-version=2023-08-01-preview"),  # the SDK: the container's next version (404: "1")
        ("PUT", f"{MODELS}/versions/1", "api-version=2023-08-01-preview"),
    ], model_calls
    (put,) = fake.model_puts()
    url = f"https://deepfleet.example.com/ui/#/jobs/{job_id}"
    with sessions() as s:
        from deepfleet.controller.db import provenance as chain

        records = chain.records(s, job_id)
        head = records[-2].hash  # the chain as registered; the registration record follows it
        assert records[-1].kind == "registration" and records[-1].data["provenance_head"] == head
    assert put.body == {"properties": {
        "description": f"deepfleet job {job_id} (gpt-small, project test): {url}",
        "tags": {"deepfleet.job-id": job_id, "deepfleet.job-url": url, "deepfleet.provenance-head": head,
                 "deepfleet.job-name": "gpt-small", "deepfleet.project": "test"},
        "properties": {"deepfleet.provenance-head": head},
        "modelType": "custom_model",
        "modelUri": f"azureml://jobs/{run}/outputs/model/paths/model.safetensors",
        "isAnonymous": False, "isArchived": False,
    }}
    assert put.authorization == "Bearer fake-token"

    # A lost commit: the next try finds the version tagged with this job and PUTs nothing.
    with sessions() as s, s.begin():
        s.get(Job, job_id).registration_state = "pending"
    rec.reconcile_once(now)
    assert job(sessions, job_id).registration_state == "registered" and len(fake.model_puts()) == 1

    second = insert_job(sessions, {**doc, "metadata": {**doc["metadata"], "name": "gpt-second"}})
    assert _succeed(rec, fake, sessions, second, now).registration["uri"] == "azureml:gpt-small:2"
    assert fake.model_puts()[-1].path == f"{MODELS}/versions/2"


def test_an_arm_refusal_is_recorded_and_the_job_stays_succeeded(fake, backend, tmp_path: Path) -> None:
    sessions = database(f"sqlite:///{tmp_path / 'db.sqlite'}")
    config = ReconcilerConfig(replica_id="r1", controller_url="http://c", secret="s", backend_name="azureml")
    rec = Reconciler(sessions, backend=backend, config=config, registry=backend.model_registry())
    doc = example_document("azureml", registerModel={"name": "gpt-small"})
    doc["metadata"]["project"] = "test"
    job_id = insert_job(sessions, doc)
    fake.fail_next("PUT", r"/models/gpt-small/versions/1$", 400, code="UserError",
                   message="Job output model has no file model.safetensors")
    now = datetime.now(timezone.utc)
    done = _succeed(rec, fake, sessions, job_id, now)
    assert done.phase == "SUCCEEDED" and done.registration_state == "failed"
    assert "HTTP 400" in done.registration["error"] and "has no file model.safetensors" in done.registration["error"]
    assert events(sessions, job_id)[-1] == "RegistrationFailed"

    throttled = insert_job(sessions, {**doc, "metadata": {**doc["metadata"], "name": "gpt-throttled"}})
    fake.fail_next("PUT", r"/models/gpt-small/versions/1$", 503, code="ServiceUnavailable", message="busy")
    retrying = _succeed(rec, fake, sessions, throttled, now)
    assert retrying.registration_state == "pending" and "HTTP 503" in retrying.registration["error"]
    rec.reconcile_once(now + timedelta(seconds=11))  # the backoff passed: the next try goes through
    assert job(sessions, throttled).registration["uri"] == "azureml:gpt-small:1"
