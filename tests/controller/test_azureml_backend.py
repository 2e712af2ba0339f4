"""The Azure ML backend through the real `MLClient` with a fake credential and a fake ARM transport: what
submit PUTs (PyTorch distribution, instance count, env vars, compute, tags), idempotent submit, the status
mapping table, cancel, logs and error translation; and `spec.registerModel`: the command job exports into a
model output, and when the job completes the reconciler registers that output's file as a workspace model
asset (`ml_client.models.create_or_update(Model(...))`), with the exact requests checked: once per job (a
lost commit adopts the version tagged with the job), the next version for the next job, and an ARM refusal
recorded on the job, which stays SUCCEEDED."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from deepfleet.controller.backends.base import BackendError, RunPhase
from deepfleet.controller.db import provenance as chain
from deepfleet.controller.db.models import Job
from deepfleet.controller.reconciler import Reconciler, ReconcilerConfig
from deepfleet.worker.spec import FailureClass
from tests.controller.example_jobs import JOB_ID, example_document, example_submission
from tests.controller.fake_azureml import SUBSCRIPTION, FakeAzureML, FakeCredential
from tests.controller.reconcile_helpers import database, events, insert_job, job

# The SDK marks many of its own classes experimental/deprecated when it imports them.
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning:azure")]

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from deepfleet.controller.backends import azureml
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


def test_submit_puts_a_pytorch_command_job(fake, backend) -> None:
    sub = example_submission("azureml")
    backend.submit(sub)
    (put,) = fake.job_puts()
    assert put.path == f"{WORKSPACE}/jobs/{sub.name}" and put.authorization == "Bearer fake-token"
    props = put.body["properties"]
    # The job's checkpoints go to its own datastore folder, the same for every attempt.
    assert props["jobType"] == "Command" and props["command"] == "deepfleet-worker --checkpoint-dir ${{outputs.checkpoints}}"
    assert props["outputs"] == {"checkpoints": {"jobOutputType": "uri_folder", "mode": "ReadWriteMount", "uri": (
        f"azureml://datastores/workspaceblobstore/paths/deepfleet/default/{JOB_ID}/checkpoints")}}
    assert not props.get("inputs")
    assert props["distribution"] == {"distributionType": "PyTorch", "processCountPerInstance": 1}
    assert props["resources"]["instanceCount"] == 2
    assert props["computeId"] == f"{WORKSPACE}/computes/gpu-cluster"
    assert props["environmentId"].startswith(f"{WORKSPACE}/environments/CliV2AnonymousEnvironment/versions/")
    env_put = next(c for c in fake.calls if "/environments/" in c.path and c.method == "PUT")
    assert env_put.body["properties"]["image"] == sub.spec.spec.image
    assert props["experimentName"] == "gpt-experiments" and props["displayName"] == "gpt-small (attempt 1)"
    assert props["tags"] | {} == {"deepfleet.job-id": JOB_ID, "deepfleet.attempt": "1", "deepfleet.run": sub.name,
                                  "deepfleet.job-name": "gpt-small", "deepfleet.project": "default"}
    env = props["environmentVariables"]
    assert {k: env[k] for k in ("DEEPFLEET_JOB_ID", "DEEPFLEET_ATTEMPT", "DEEPFLEET_TOKEN", "DEEPFLEET_HEARTBEAT_URL")} == \
        {k: sub.env[k] for k in ("DEEPFLEET_JOB_ID", "DEEPFLEET_ATTEMPT", "DEEPFLEET_TOKEN", "DEEPFLEET_HEARTBEAT_URL")}
    assert env["DEEPFLEET_NNODES"] == "2"
    worker = json.loads(env["DEEPFLEET_WORKER_SPEC"])
    assert worker["platform"] == "azureml" and worker["processes_per_node"] == 1 and worker["job_id"] == JOB_ID


def test_a_registered_environment_is_used_by_reference(fake, backend) -> None:
    sub = example_submission("azureml", azureml={"compute": "cpu", "environment": "deepfleet-worker:3"})
    backend.submit(sub)
    props = fake.job_puts()[0].body["properties"]
    assert props["environmentId"] == f"{WORKSPACE}/environments/deepfleet-worker/versions/3"
    assert props["experimentName"] == "default"  # the project when no experiment is named
    assert not [c for c in fake.calls if "/environments/" in c.path]


def test_submit_is_idempotent(fake, backend) -> None:
    sub = example_submission("azureml")
    backend.submit(sub)
    backend.submit(sub)
    assert len(fake.job_puts()) == 1
    with pytest.raises(BackendError, match="belongs to job") as err:
        backend.submit(replace(sub, job_id="another"))
    assert not err.value.transient


STATUS_TABLE = [
    ("NotStarted", RunPhase.PENDING), ("Queued", RunPhase.PENDING), ("Preparing", RunPhase.PENDING),
    ("Provisioning", RunPhase.PENDING), ("Starting", RunPhase.PENDING), ("Paused", RunPhase.PENDING),
    ("Running", RunPhase.RUNNING), ("Finalizing", RunPhase.RUNNING), ("CancelRequested", RunPhase.RUNNING),
    ("NotResponding", RunPhase.RUNNING), ("Completed", RunPhase.SUCCEEDED), ("Failed", RunPhase.FAILED),
    ("Canceled", RunPhase.FAILED),
]


@pytest.mark.parametrize(("status", "phase"), STATUS_TABLE)
def test_status_mapping(fake, backend, status, phase) -> None:
    sub = example_submission("azureml")
    backend.submit(sub)
    fake.set_status(sub.name, status)
    obs = backend.observe(sub.name)
    assert obs.phase is phase
    assert (obs.failure_class is FailureClass.SUCCEEDED) == (phase is RunPhase.SUCCEEDED)


def test_every_azure_status_is_mapped() -> None:
    assert {s for s, _ in STATUS_TABLE} == set(azureml.PHASES)


@pytest.mark.parametrize(("message", "expected", "codes"), [
    ("UserError: User process 'deepfleet-worker' exited with status code 77", FailureClass.OOM, {0: 77}),
    ("UserError: User process 'deepfleet-worker' exited with status code 76", FailureClass.COMM_FAILURE, {0: 76}),
    ("UserError: User process 'deepfleet-worker' exited with status code 65", FailureClass.USER_ERROR, {0: 65}),
    ("Execution failed: CUDA out of memory", FailureClass.OOM, {}),
    ("", FailureClass.UNKNOWN, {}),
])
def test_failures_are_classified_from_azures_message(message, expected, codes) -> None:
    obs = azureml.observation("Failed", message=message)
    assert obs.phase is RunPhase.FAILED and obs.failure_class is expected and obs.exit_codes == codes


def test_unknown_job_is_not_found(backend) -> None:
    assert backend.observe("df-none-00000000-a1").phase is RunPhase.NOT_FOUND
    backend.cancel("df-none-00000000-a1")  # idempotent


def test_cancel_posts_the_cancel_action(fake, backend) -> None:
    sub = example_submission("azureml")
    backend.submit(sub)
    fake.set_status(sub.name, "Running")
    backend.cancel(sub.name)
    posts = [c for c in fake.calls if c.method == "POST"]
    assert [c.path for c in posts] == [f"{WORKSPACE}/jobs/{sub.name}/cancel"]
    assert backend.observe(sub.name).phase is RunPhase.FAILED
    backend.cancel(sub.name)  # already over: no second cancel
    assert len([c for c in fake.calls if c.method == "POST"]) == 1


def test_logs_are_read_per_node_through_the_sdks_run_history(fake, backend) -> None:
    sub = example_submission("azureml")
    backend.submit(sub)
    fake.set_status(sub.name, "Running")
    with pytest.raises(BackendError, match=f"job {sub.name} has no log for node 1"):
        list(backend.logs(sub.name, node=1))
    fake.append_log(sub.name, 0, "node0 step 1\n")
    fake.append_log(sub.name, 1, "node1 step 1\nnode1 step 2\nnode1 step 3\n")
    assert list(backend.logs(sub.name, node=1)) == ["node1 step 1\n", "node1 step 2\n", "node1 step 3\n"]
    assert list(backend.logs(sub.name, node=1, tail=1)) == ["node1 step 3\n"]
    assert list(backend.logs(sub.name, node=0)) == ["node0 step 1\n"]
    # the SDK's path: the run-history details list the files, their (SAS) URLs answer the text
    assert any(c.path.endswith(f"/runs/{sub.name}/details") for c in fake.calls)
    with pytest.raises(BackendError, match="no job df-nope"):
        list(backend.logs("df-nope"))


def test_following_a_log_yields_new_lines_until_the_job_ends(fake, backend) -> None:
    sub = example_submission("azureml")
    backend.submit(sub)
    fake.set_status(sub.name, "Running")
    fake.append_log(sub.name, 0, "step 1\n")
    backend.log_poll_s = 0.01
    lines = backend.logs(sub.name, follow=True)
    assert next(lines) == "step 1\n"
    fake.append_log(sub.name, 0, "step 2\nstep 3\n")
    assert next(lines) == "step 2\n"
    fake.set_status(sub.name, "Completed")
    assert list(lines) == ["step 3\n"]


@pytest.mark.parametrize(("status", "code", "transient"), [
    (400, "UserError", False), (403, "AuthorizationFailed", False), (404, "ComputeNotFound", False),
    (429, "TooManyRequests", True), (503, "ServiceUnavailable", True),
])
def test_error_responses_become_backend_errors(fake, backend, status, code, transient) -> None:
    sub = example_submission("azureml")
    fake.fail_next("PUT", r"/jobs/[^/]+$", status, code=code, message=f"compute 'gpu-cluster': {code}")
    with pytest.raises(BackendError) as err:
        backend.submit(sub)
    assert err.value.transient is transient
    assert str(err.value).startswith(f"azureml: create job {sub.name}: HTTP {status}") and code in str(err.value)


def test_one_transient_error_is_retried_by_the_sdk(fake) -> None:
    sub = example_submission("azureml")
    backend = AzureMLBackend(connect(SUBSCRIPTION, "rg", "ws", credential=FakeCredential(), transport=fake,
                                     retry_backoff_factor=0))
    fake.fail_next("PUT", r"/jobs/[^/]+$", 503, code="ServiceUnavailable")
    backend.submit(sub)
    assert len(fake.job_puts()) == 2 and sub.name in fake.jobs


def test_observe_errors_are_translated(fake, backend) -> None:
    fake.fail_next("GET", r"/jobs/", 500, code="InternalServerError")
    with pytest.raises(BackendError, match="HTTP 500") as err:
        backend.observe("df-x-00000000-a1")
    assert err.value.transient


def test_the_workspace_comes_from_the_environment(fake) -> None:
    with pytest.raises(BackendError, match="set AZURE_RESOURCE_GROUP, AZUREML_WORKSPACE"):
        azureml.from_env({"AZURE_SUBSCRIPTION_ID": SUBSCRIPTION})
    env = {"AZURE_SUBSCRIPTION_ID": SUBSCRIPTION, "AZURE_RESOURCE_GROUP": "rg", "AZUREML_WORKSPACE": "ws"}
    backend = azureml.from_env(env, credential=FakeCredential(), transport=fake)
    assert backend.observe("df-x-00000000-a1").phase is RunPhase.NOT_FOUND
    assert fake.calls[-1].path == f"{WORKSPACE}/jobs/df-x-00000000-a1"


def test_secret_references_go_as_key_vault_references_with_a_managed_identity(fake) -> None:
    vault = "https://df-vault.vault.azure.net"
    backend = AzureMLBackend(connect(SUBSCRIPTION, "rg", "ws", credential=FakeCredential(), transport=fake,
                                     retry_total=0), key_vault_url=vault)
    sub = example_submission("azureml", env={"HF_TOKEN": {"secret": "hf-token"}, "TEAM": "nlp"})
    backend.submit(sub)
    props = fake.job_puts()[0].body["properties"]
    env = props["environmentVariables"]
    assert env["DEEPFLEET_KEYVAULT_URL"] == vault
    assert json.loads(env["DEEPFLEET_KEYVAULT_SECRETS"]) == {"HF_TOKEN": "hf-token"}
    assert "HF_TOKEN" not in env and json.loads(env["DEEPFLEET_WORKER_SPEC"])["env"] == {"TEAM": "nlp"}
    assert props["identity"] == {"identityType": "Managed"}


def test_a_secret_reference_without_a_key_vault_fails_the_submit_permanently(fake, backend) -> None:
    sub = example_submission("azureml", env={"HF_TOKEN": {"secret": "hf-token"}})
    with pytest.raises(BackendError, match="DEEPFLEET_AZUREML_KEY_VAULT") as err:
        backend.submit(sub)
    assert not err.value.transient and fake.job_puts() == []


def test_a_job_that_registers_its_model_exports_into_a_model_output(fake, backend) -> None:
    sub = example_submission("azureml", registerModel={"name": "gpt-small", "dtype": "bf16"})
    backend.submit(sub)
    props = fake.job_puts()[0].body["properties"]
    assert props["command"] == ("deepfleet-worker --checkpoint-dir ${{outputs.checkpoints}} "
                                "--export-dir ${{outputs.model}}")
    assert props["outputs"]["model"] == {"jobOutputType": "uri_folder", "mode": "ReadWriteMount"}
    worker = json.loads(props["environmentVariables"]["DEEPFLEET_WORKER_SPEC"])
    assert worker["export"] == {"dtype": "bf16"}
    plain = example_submission("azureml", job_id="0" * 32, checkpoint=None)
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
