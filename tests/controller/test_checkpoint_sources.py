"""A job on Kubernetes or Azure ML that starts from another job's checkpoint (`checkpoint.resumeFrom`) or
serves it (a ServingJob's `model.job`): the exact objects and requests the backends send (the source's
claim directory mounted read-only with its subPath, or its datastore folder as a read-only `uri_folder`
input, and the WorkerSpec / worker options that say where it is), the manifests against the upstream
schemas, the refusals at submit (one line naming the field: a source on another backend, without a
claim or checkpoints, in another namespace, on a claim the policy no longer allows), and the reconciler
carrying the stored source job's claim into the Job it creates (PostgreSQL, fake API server)."""

from __future__ import annotations

import json
import textwrap
import warnings
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deepfleet.controller.backends.base import BackendError
from deepfleet.controller.backends.kubernetes import manifests, names
from deepfleet.controller.backends.kubernetes.backend import KubernetesBackend, connect
from deepfleet.controller.db.models import Attempt, Job
from deepfleet.controller.reconciler import Reconciler, ReconcilerConfig
from deepfleet.controller.settings import Settings
from deepfleet.controller.sources import CheckpointSource, reach_errors
from deepfleet.worker.spec import WorkerSpec
from tests.controller.api.helpers import job_yaml, token, yaml_headers
from tests.controller.example_jobs import IMAGE, JOB_ID, TRAINED, example_submission, serving_document
from tests.controller.example_jobs import serving_submission as compiled
from tests.controller.fake_kube import FakeKubeAPI

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning:azure")]

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

    from deepfleet.controller.app import create_app
    from deepfleet.controller.backends.azureml import AzureMLBackend
    from deepfleet.controller.backends.azureml import connect as aml_connect
    from tests.controller.fake_azureml import SUBSCRIPTION, FakeAzureML, FakeCredential

K8S_SOURCE = CheckpointSource(job_id=TRAINED, project="default", backend="kubernetes", dir="/ck", claim="ckpt")
AML_SOURCE = CheckpointSource(job_id=TRAINED, project="default", backend="azureml", dir="ck")
SOURCE_MOUNT = {"name": "source-checkpoint", "mountPath": "/mnt/deepfleet/source-checkpoint", "readOnly": True,
                "subPath": f"default/{TRAINED}"}
SOURCE_VOLUME = {"name": "source-checkpoint", "persistentVolumeClaim": {"claimName": "ckpt", "readOnly": True}}


def _pod(job: dict) -> dict:
    return job["spec"]["template"]["spec"]


def _worker(job: dict) -> WorkerSpec:
    env = _pod(job)["containers"][0]["env"]
    return WorkerSpec.model_validate_json(next(e["value"] for e in env if e["name"] == "DEEPFLEET_WORKER_SPEC"))


# ------------------------------------------------------------------------------------------ which sources
@pytest.mark.parametrize(("source", "backend", "namespace", "claims", "line"), [
    (replace(K8S_SOURCE, backend="local"), "kubernetes", None, ["ckpt"],
     f"f: job '{TRAINED}' ran on backend local, where a job on backend kubernetes cannot read its checkpoints; "
     "name a job that ran on backend kubernetes, or run this one on local"),
    (replace(K8S_SOURCE, dir=None), "kubernetes", None, ["ckpt"], "kept no checkpoints"),
    (replace(K8S_SOURCE, claim=None), "kubernetes", None, ["ckpt"], "kept its checkpoints on no volume"),
    (replace(K8S_SOURCE, namespace="team-a"), "kubernetes", None, ["ckpt"],
     f"f: job '{TRAINED}' keeps its checkpoints on claim 'ckpt' in namespace 'team-a', which pods in 'default' "
     "cannot mount; set spec.kubernetes.namespace: team-a"),
    (K8S_SOURCE, "kubernetes", None, [], "may no longer mount (allowed: none); ask an admin to allow it"),
    (K8S_SOURCE, "azureml", None, [], "ran on backend kubernetes, where a job on backend azureml cannot read"),
    (replace(AML_SOURCE, dir=None), "azureml", None, [], "kept no checkpoints"),
])
def test_a_source_the_backend_cannot_reach_is_one_line_naming_the_field(source, backend, namespace, claims,
                                                                        line) -> None:
    errors = reach_errors(source, backend=backend, namespace=namespace, field="f", default_namespace="default",
                          allowed_claims=claims)
    assert len(errors) == 1 and errors[0].startswith("f: ") and line in errors[0], errors


def test_reachable_sources_have_no_errors() -> None:
    ok = {"field": "f", "default_namespace": "default", "allowed_claims": ["ckpt"]}
    assert reach_errors(K8S_SOURCE, backend="kubernetes", namespace="default", **ok) == []
    assert reach_errors(replace(K8S_SOURCE, namespace="team-a"), backend="kubernetes", namespace="team-a", **ok) == []
    assert reach_errors(AML_SOURCE, backend="azureml", namespace=None, **ok) == []
    assert reach_errors(replace(K8S_SOURCE, backend="local", dir=None), backend="local", namespace=None, **ok) == []


# ------------------------------------------------------------------------------------------ kubernetes
@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_a_serving_pod_mounts_the_trained_jobs_claim_directory_read_only(version: str) -> None:
    sub = compiled(serving_document(backend="kubernetes", image=IMAGE), K8S_SOURCE)
    objects = manifests.render(sub, namespace="default", job_uid="5b7d7c52-0000-4000-8000-000000000001")
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)
    pod = _pod(objects[0])
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, SOURCE_VOLUME]
    assert pod["containers"][0]["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}, SOURCE_MOUNT]
    worker = _worker(objects[0])
    assert worker.checkpoint.dir == SOURCE_MOUNT["mountPath"] and worker.resume_dir is None
    assert worker.serve is not None and worker.checkpoint.resume_from == TRAINED


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_a_training_job_resuming_another_mounts_its_own_directory_and_the_source_read_only(version: str) -> None:
    sub = example_submission("kubernetes", kubernetes={"checkpointClaim": "ckpt"},
                             checkpoint={"dir": "/checkpoints/gpt", "resumeFrom": TRAINED})
    sub = replace(sub, checkpoint_source=K8S_SOURCE)
    job = manifests.job(sub, namespace="default")
    kubernetes_validate.validate(job, version, strict=True)
    pod = _pod(job)
    assert pod["volumes"][1:] == [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}},
                                  SOURCE_VOLUME]
    assert pod["containers"][0]["volumeMounts"][1:] == [{"name": "checkpoints", "mountPath": "/checkpoints/gpt"},
                                                         SOURCE_MOUNT]
    worker = _worker(job)  # trains in its own directory, starting from a copy of the source's newest checkpoint
    assert worker.checkpoint.dir == f"/checkpoints/gpt/default/{JOB_ID}"
    assert worker.resume_dir == SOURCE_MOUNT["mountPath"]


@pytest.fixture()
def fake_kube() -> Iterator[FakeKubeAPI]:
    f = FakeKubeAPI().start()
    yield f
    f.stop()


@pytest.fixture()
def kube(fake_kube: FakeKubeAPI, tmp_path: Path) -> Iterator[KubernetesBackend]:
    b = KubernetesBackend(connect(fake_kube.kubeconfig(tmp_path / "kubeconfig")), namespace="default",
                          watch_timeout_s=2)
    yield b
    b.close()


def test_the_job_sent_to_the_api_server_carries_the_read_only_mount(fake_kube, kube) -> None:
    sub = compiled(serving_document(backend="kubernetes", image=IMAGE), K8S_SOURCE)
    kube.submit(sub)
    (post,) = fake_kube.calls("POST", "/jobs")
    sent = _pod(post.body)
    assert SOURCE_VOLUME in sent["volumes"] and SOURCE_MOUNT in sent["containers"][0]["volumeMounts"]
    (pod,) = fake_kube.list("pods", "default", f"{names.RUN}={sub.name}")
    assert SOURCE_MOUNT in pod["spec"]["containers"][0]["volumeMounts"]


@pytest.mark.parametrize("source", [None, replace(K8S_SOURCE, claim=None), replace(K8S_SOURCE, backend="local"),
                                    replace(K8S_SOURCE, job_id="another")])
def test_a_source_without_a_claim_fails_the_submit_before_any_request(fake_kube, kube, source) -> None:
    sub = compiled(serving_document(backend="kubernetes", image=IMAGE), source)
    with pytest.raises(BackendError, match="checkpoint.resumeFrom: job '0123456789abcdef0123456789abcdef' kept no "
                                           "checkpoints on a claim of this cluster") as err:
        kube.submit(sub)
    assert not err.value.transient and fake_kube.calls("POST") == []


# ------------------------------------------------------------------------------------------ azure ml
@pytest.fixture()
def fake_aml() -> FakeAzureML:
    return FakeAzureML()


@pytest.fixture()
def aml(fake_aml: FakeAzureML) -> AzureMLBackend:
    return AzureMLBackend(aml_connect(SUBSCRIPTION, "rg", "ws", credential=FakeCredential(), transport=fake_aml,
                                      retry_total=0))


SOURCE_INPUT = {"jobInputType": "uri_folder", "mode": "ReadOnlyMount",
                "uri": f"azureml://datastores/workspaceblobstore/paths/deepfleet/default/{TRAINED}/checkpoints"}


def test_an_azureml_serving_job_reads_the_trained_jobs_folder_as_a_read_only_input(fake_aml, aml) -> None:
    sub = compiled(serving_document(backend="azureml", image=IMAGE, azureml={"compute": "cpu"}), AML_SOURCE)
    aml.submit(sub)
    (put,) = fake_aml.job_puts()
    props = put.body["properties"]
    assert props["inputs"] == {"checkpoint": SOURCE_INPUT} and not props.get("outputs")
    assert props["command"] == "deepfleet-worker --checkpoint-dir ${{inputs.checkpoint}}"


def test_an_azureml_training_job_resuming_another_gets_its_folder_and_its_own_output(fake_aml) -> None:
    backend = AzureMLBackend(aml_connect(SUBSCRIPTION, "rg", "ws", credential=FakeCredential(), transport=fake_aml,
                                         retry_total=0), datastore="checkpoints")
    sub = example_submission("azureml", checkpoint={"dir": "ck", "resumeFrom": TRAINED})
    backend.submit(replace(sub, checkpoint_source=AML_SOURCE))
    props = fake_aml.job_puts()[0].body["properties"]
    folder = "azureml://datastores/checkpoints/paths/deepfleet/default"
    assert props["inputs"] == {"checkpoint": {**SOURCE_INPUT, "uri": f"{folder}/{TRAINED}/checkpoints"}}
    assert props["outputs"] == {"checkpoints": {"jobOutputType": "uri_folder", "mode": "ReadWriteMount",
                                                "uri": f"{folder}/{JOB_ID}/checkpoints"}}
    assert props["command"] == ("deepfleet-worker --checkpoint-dir ${{outputs.checkpoints}} "
                                "--resume-dir ${{inputs.checkpoint}}")


@pytest.mark.parametrize("source", [None, K8S_SOURCE, replace(AML_SOURCE, dir=None)])
def test_an_azureml_source_that_is_not_a_workspace_folder_fails_the_submit(fake_aml, aml, source) -> None:
    sub = compiled(serving_document(backend="azureml", image=IMAGE, azureml={"compute": "cpu"}), source)
    with pytest.raises(BackendError, match="kept no checkpoints in this workspace") as err:
        aml.submit(sub)
    assert not err.value.transient and fake_aml.job_puts() == []


# ------------------------------------------------------------------------------------------ the API
TRAINING = textwrap.dedent("""
    apiVersion: deepfleet/v1
    kind: TrainingJob
    metadata: {name: trained, project: research}
    spec:
      backend: BACKEND
      image: ghcr.io/acme/worker:1
      entrypoint: {script: train.py}
""")


def _training(backend: str, **spec: object) -> str:
    doc = yaml.safe_load(TRAINING.replace("BACKEND", backend))
    doc["spec"].update(spec)
    return yaml.safe_dump(doc)


def _serving(source: str, **spec: object) -> str:
    doc = serving_document(backend="kubernetes", image="ghcr.io/acme/worker:1", **spec)
    doc["metadata"]["project"] = "research"
    doc["spec"]["model"]["job"] = source
    return yaml.safe_dump(doc)


def _app(settings: Settings, tmp_path: Path, policy: str):
    (tmp_path / "policy.yaml").write_text(policy)
    return create_app(settings.model_copy(update={"policy_file": tmp_path / "policy.yaml",
                                                  "backends": ["local", "kubernetes", "azureml"]}))


def _finished(client, app, auth, body: str) -> str:
    r = client.post("/v1/jobs", content=body, headers=auth)
    assert r.status_code == 201, r.text
    with app.state.sessions() as session:
        session.get(Job, r.json()["id"]).phase = "SUCCEEDED"
        session.commit()
    return r.json()["id"]


def _errors(client, auth, body: str) -> list[str]:
    r = client.post("/v1/jobs", content=body, headers=auth)
    assert r.status_code == 422, r.text
    return r.json()["errors"]


def test_the_api_refuses_sources_the_backend_cannot_reach(settings: Settings, tmp_path: Path) -> None:
    app = _app(settings, tmp_path, "research: {claims: [ckpt, retired], namespaces: [team-a]}\n")
    with TestClient(app) as client:
        auth = yaml_headers(token(app, project="research", role="member"))
        local = _finished(client, app, auth, job_yaml())
        no_claim = _finished(client, app, auth, _training("kubernetes", checkpoint={"dir": "/ck"}))
        no_checkpoint = _finished(client, app, auth, _training("kubernetes"))
        elsewhere = _finished(client, app, auth, _training("kubernetes", checkpoint={"dir": "/ck"}, kubernetes={
            "checkpointClaim": "ckpt", "namespace": "team-a"}))
        retired = _finished(client, app, auth, _training("kubernetes", checkpoint={"dir": "/ck"},
                                                         kubernetes={"checkpointClaim": "retired"}))
        trained = _finished(client, app, auth, _training("kubernetes", checkpoint={"dir": "/ck"},
                                                         kubernetes={"checkpointClaim": "ckpt"}))
        assert _errors(client, auth, _serving(local)) == [
            f"spec.model.job: job {local!r} ran on backend local, where a job on backend kubernetes cannot read its "
            "checkpoints; name a job that ran on backend kubernetes, or run this one on local"]
        assert _errors(client, auth, _serving(no_claim)) == [
            f"spec.model.job: job {no_claim!r} kept its checkpoints on no volume (no kubernetes.checkpointClaim), so "
            "they were gone with its pods; name a job that had a checkpointClaim"]
        assert _errors(client, auth, _serving(no_checkpoint)) == [
            f"spec.model.job: job {no_checkpoint!r} kept no checkpoints (its spec has no checkpoint section); name "
            "a job that saved one"]
        assert _errors(client, auth, _serving(elsewhere)) == [
            f"spec.model.job: job {elsewhere!r} keeps its checkpoints on claim 'ckpt' in namespace 'team-a', which "
            "pods in 'default' cannot mount; set spec.kubernetes.namespace: team-a"]
        assert client.post("/v1/jobs", content=_serving(elsewhere, kubernetes={"namespace": "team-a"}),
                           headers=auth).status_code == 201
        resume = _training("azureml", azureml={"compute": "cpu"}, checkpoint={"dir": "ck", "resumeFrom": trained})
        assert _errors(client, auth, resume) == [
            f"spec.checkpoint.resumeFrom: job {trained!r} ran on backend kubernetes, where a job on backend azureml "
            "cannot read its checkpoints; name a job that ran on backend azureml, or run this one on kubernetes"]
    # The admin withdrew a claim: what is kept on it can no longer be mounted by this project.
    app = _app(settings, tmp_path, "research: {claims: [ckpt]}\n")
    with TestClient(app) as client:
        auth = yaml_headers(token(app, project="research", role="member"))
        assert _errors(client, auth, _serving(retired)) == [
            f"spec.model.job: job {retired!r} keeps its checkpoints on claim 'retired', which this project may no "
            "longer mount (allowed: ckpt); ask an admin to allow it"]


def test_the_reconciler_mounts_the_stored_source_jobs_claim(settings: Settings, tmp_path: Path, fake_kube) -> None:
    app = _app(settings, tmp_path, "research: {claims: [ckpt]}\n")
    backend = KubernetesBackend(connect(fake_kube.kubeconfig(tmp_path / "kubeconfig")), namespace="default",
                                watch_timeout_s=2)
    try:
        with TestClient(app) as client:
            auth = yaml_headers(token(app, project="research", role="member"))
            trained = _finished(client, app, auth, _training("kubernetes", checkpoint={"dir": "/ck"},
                                                             kubernetes={"checkpointClaim": "ckpt"}))
            r = client.post("/v1/jobs", content=_serving(trained), headers=auth)
            assert r.status_code == 201, r.text
            served = r.json()["id"]
            config = ReconcilerConfig(replica_id="r1", controller_url="http://ctl:8000", secret="s",
                                      backend_name="kubernetes")
            rec = Reconciler(app.state.sessions, backend=backend, config=config)
            rec.reconcile_once(datetime.now(timezone.utc))  # admit
            rec.reconcile_once(datetime.now(timezone.utc))  # submit
            with app.state.sessions() as s:
                run = s.query(Attempt).filter_by(job_id=served).one().run_name
        job = fake_kube.get("jobs", "default", run)
        mounts = _pod(job)["containers"][0]["volumeMounts"]
        assert {**SOURCE_MOUNT, "subPath": f"research/{trained}"} in mounts
        assert SOURCE_VOLUME in _pod(job)["volumes"]
        worker = json.loads(next(e["value"] for e in _pod(job)["containers"][0]["env"]
                                 if e["name"] == "DEEPFLEET_WORKER_SPEC"))
        assert worker["checkpoint"]["dir"] == SOURCE_MOUNT["mountPath"]
    finally:
        backend.close()
