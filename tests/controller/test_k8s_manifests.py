"""The Kubernetes manifests of one attempt of the example job: upstream schema validation at two
Kubernetes versions, the name/label rules the schemas miss, the Indexed-Job layout the worker's
rendezvous relies on, the worker token kept out of the Job (in an owned Secret), and golden files
(regenerate with DEEPFLEET_UPDATE_GOLDEN=1)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deepfleet.controller.backends.kubernetes import manifests, names
from deepfleet.worker.spec import TOKEN_ENV
from tests.controller.example_jobs import IMAGE, JOB_ID, example_submission

GOLDEN = Path(__file__).with_name("golden")
VERSIONS = ["1.30.0", "1.33.0"]
JOB_UID = "5b7d7c52-0000-4000-8000-000000000001"


def _objects(**overrides):
    return manifests.render(example_submission("kubernetes", **overrides), namespace="default", job_uid=JOB_UID)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("variant", ["full", "kueue", "cpu-only"])
def test_manifests_pass_the_upstream_schemas_strictly(version: str, variant: str) -> None:
    overrides = {
        "full": {},
        "kueue": {"kubernetes": {"kueueQueue": "team-a"}},
        "cpu-only": {"kubernetes": None, "resources": {"cpu": "1"}},
    }[variant]
    objects = _objects(**overrides)
    assert [o["kind"] for o in objects] == ["Job", "Secret", "Service"]
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_schema_validation_catches_a_broken_secret(version: str) -> None:
    secret = _objects()[1]
    secret["stringdata"] = secret.pop("stringData")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(secret, version, strict=True)


def test_schema_validation_catches_a_broken_manifest() -> None:
    job = _objects()[0]
    job["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, "1.33.0", strict=True)


def test_names_and_labels_fit_what_the_api_server_accepts() -> None:
    job, secret, svc = _objects()
    for obj in (job, secret, svc, job["spec"]["template"]):
        names.check_labels(obj["metadata"]["labels"], where=obj.get("kind", "pod template"))
    for obj in (job, secret, svc):
        names.check_dns_label(obj["metadata"]["name"], where=obj["kind"])
    nodes = job["spec"]["completions"]
    names.check_dns_label(names.pod_hostname(job["metadata"]["name"], nodes - 1), where="hostname")
    # The longest job name the JobSpec allows still yields valid names at a three-digit node count.
    long = example_submission("kubernetes", nodes=128, attempt=99)
    long_job = manifests.job(replace(long, name="df-" + "a" * 40 + "-3f2a9c1e-a99"), namespace="default")
    assert long_job["spec"]["completions"] == 128 and len(long_job["metadata"]["name"]) == 56
    long_secret = manifests.secret(replace(long, name="df-" + "a" * 40 + "-3f2a9c1e-a99"), namespace="default",
                                   job_uid=None)
    names.check_dns_label(long_secret["metadata"]["name"], where="secret name")


def test_name_and_label_checks_reject_what_the_schemas_let_through() -> None:
    with pytest.raises(ValueError, match="job name: 'Train_ABC' is not a DNS-1123 label"):
        names.check_dns_label("Train_ABC", where="job name")
    with pytest.raises(ValueError, match="pod hostname"):
        names.check_dns_label(names.pod_hostname("x" * 62, 10), where="pod hostname")
    with pytest.raises(ValueError, match="not a valid label value"):
        names.check_labels({"team": "-bad"}, where="job")
    with pytest.raises(ValueError, match="not a valid label value"):
        names.check_labels({"team": "v" * 64}, where="job")
    with pytest.raises(ValueError, match="not a valid label name"):
        names.check_labels({"bad key": "x"}, where="job")
    sub = example_submission("kubernetes")
    with pytest.raises(ValueError, match="job name"):
        manifests.job(replace(sub, name="Bad_Name"), namespace="default")
    with pytest.raises(ValueError, match="secret name: '.*-token' is not a DNS-1123 label"):
        manifests.job(replace(sub, name="x" * 60), namespace="default")


def test_the_token_is_in_an_owned_secret_and_nowhere_in_the_job() -> None:
    sub = example_submission("kubernetes")
    token = sub.env[TOKEN_ENV]
    assert len(token) >= 16
    job, secret, svc = manifests.render(sub, namespace="default", job_uid=JOB_UID)
    assert token not in json.dumps(job) and token not in json.dumps(svc)
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    (var,) = [e for e in env if e["name"] == TOKEN_ENV]
    assert var == {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": f"{sub.name}-token", "key": TOKEN_ENV}}}
    # Only the secret values move: everything else the submission sets stays a plain value (the WorkerSpec
    # is re-rendered for the platform, see test_golden_files).
    plain = {e["name"]: e["value"] for e in env if "value" in e}
    assert set(sub.env) - {TOKEN_ENV} <= plain.keys()
    assert all(plain[k] == v for k, v in sub.env.items() if k not in (TOKEN_ENV, "DEEPFLEET_WORKER_SPEC"))
    assert secret["metadata"]["name"] == f"{sub.name}-token" and secret["metadata"]["namespace"] == "default"
    assert secret["stringData"] == {TOKEN_ENV: token} and "data" not in secret
    assert (secret["type"], secret["immutable"]) == ("Opaque", True)
    assert secret["metadata"]["labels"] == svc["metadata"]["labels"]
    assert secret["metadata"]["ownerReferences"] == svc["metadata"]["ownerReferences"] == [
        {"apiVersion": "batch/v1", "kind": "Job", "name": sub.name, "uid": JOB_UID, "blockOwnerDeletion": True}]


def test_indexed_job_layout() -> None:
    job, _, svc = _objects()
    spec = job["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert (spec["completionMode"], spec["completions"], spec["parallelism"], spec["backoffLimit"]) == ("Indexed", 2, 2, 0)
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == svc["metadata"]["name"] == job["metadata"]["name"]
    assert container["image"] == IMAGE and container["command"] == ["deepfleet-worker"]
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"},
                                      "limits": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"}}
    assert pod["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert (pod["priorityClassName"], pod["serviceAccountName"], pod["imagePullSecrets"]) == \
        ("training", "deepfleet-worker", [{"name": "regcred"}])
    assert pod["terminationGracePeriodSeconds"] == 120
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]
    assert container["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert env["DEEPFLEET_K8S_JOB"] == env["DEEPFLEET_RDZV_SERVICE"] == job["metadata"]["name"]
    assert env["DEEPFLEET_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["DEEPFLEET_NNODES"] == "2" and env["DEEPFLEET_MASTER_PORT"] == "29400"
    assert '"platform": "kubernetes"' in env["DEEPFLEET_WORKER_SPEC"]
    assert {"DEEPFLEET_JOB_ID", "DEEPFLEET_ATTEMPT", "DEEPFLEET_HEARTBEAT_URL", "DEEPFLEET_TOKEN"} <= env.keys()
    labels = job["metadata"]["labels"]
    assert labels[names.JOB_ID] == "3f2a9c1e7b5d4e60a1b2c3d4e5f60718" and labels[names.ATTEMPT] == "1"
    assert labels[names.MANAGED_BY] == "deepfleet" and "suspend" not in spec
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {names.RUN: job["metadata"]["name"]}
    assert spec["template"]["metadata"]["labels"][names.RUN] == job["metadata"]["name"]
    assert svc["metadata"]["ownerReferences"] == [{"apiVersion": "batch/v1", "kind": "Job", "name": job["metadata"]["name"],
                                                   "uid": JOB_UID, "blockOwnerDeletion": True}]


def test_kueue_queue_suspends_the_job_and_labels_it() -> None:
    job, secret, svc = _objects(kubernetes={"kueueQueue": "team-a"})
    assert job["spec"]["suspend"] is True
    assert job["metadata"]["labels"][names.KUEUE_QUEUE] == "team-a"
    assert names.KUEUE_QUEUE not in svc["metadata"]["labels"] and names.KUEUE_QUEUE not in secret["metadata"]["labels"]


def test_namespace_from_the_spec_wins_over_the_backend_default() -> None:
    job, secret, svc = manifests.render(example_submission("kubernetes", kubernetes={"namespace": "team-a"}),
                                        namespace="default")
    assert job["metadata"]["namespace"] == secret["metadata"]["namespace"] == svc["metadata"]["namespace"] == "team-a"
    assert "ownerReferences" not in svc["metadata"] and "ownerReferences" not in secret["metadata"]


def test_golden_files() -> None:
    job, secret, svc = _objects()
    # The WorkerSpec's own fields belong to the worker's contract; the manifest only carries it (checked above).
    for var in job["spec"]["template"]["spec"]["containers"][0]["env"]:
        if var["name"] == "DEEPFLEET_WORKER_SPEC":
            assert json.loads(var["value"]) == json.loads(example_submission("kubernetes").env["DEEPFLEET_WORKER_SPEC"])
            var["value"] = "<the WorkerSpec as JSON>"
    # The token is an HMAC of the test secret (checked above); the golden file shows where it goes.
    assert secret["stringData"][TOKEN_ENV] == example_submission("kubernetes").env[TOKEN_ENV]
    secret["stringData"][TOKEN_ENV] = "<the job token>"
    for name, obj in (("k8s-job.yaml", job), ("k8s-secret.yaml", secret), ("k8s-service.yaml", svc)):
        text = yaml.safe_dump(obj, sort_keys=True, width=100)
        path = GOLDEN / name
        if os.environ.get("DEEPFLEET_UPDATE_GOLDEN"):
            path.write_text(text)
        assert path.exists(), f"{path} missing; run with DEEPFLEET_UPDATE_GOLDEN=1 to create it"
        assert text == path.read_text(), f"{name} changed; review and regenerate with DEEPFLEET_UPDATE_GOLDEN=1"


def _worker_checkpoint_dir(job: dict) -> str:
    env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    return json.loads(next(e["value"] for e in env if e["name"] == "DEEPFLEET_WORKER_SPEC"))["checkpoint"]["dir"]


def test_checkpoint_claim_is_mounted_at_the_checkpoint_dir_in_every_pod() -> None:
    """Each job keeps its checkpoints in its own directory on the claim (the same for every attempt), so
    jobs sharing a claim never resume from each other's checkpoints."""
    job, _, _ = _objects(kubernetes={"checkpointClaim": "gpt-ckpt"}, checkpoint={"dir": "/checkpoints/gpt", "everySteps": 10})
    pod = job["spec"]["template"]["spec"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "gpt-ckpt"}} in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "checkpoints", "mountPath": "/checkpoints/gpt"} in mounts
    assert _worker_checkpoint_dir(job) == f"/checkpoints/gpt/default/{JOB_ID}"
    later = manifests.job(example_submission("kubernetes", attempt=3, kubernetes={"checkpointClaim": "gpt-ckpt"},
                                             checkpoint={"dir": "/checkpoints/gpt/"}), namespace="default")
    assert _worker_checkpoint_dir(later) == f"/checkpoints/gpt/default/{JOB_ID}"
    other = manifests.job(example_submission("kubernetes", job_id="0" * 32, kubernetes={"checkpointClaim": "gpt-ckpt"},
                                             checkpoint={"dir": "/checkpoints/gpt"}), namespace="default")
    assert _worker_checkpoint_dir(other) == f"/checkpoints/gpt/default/{'0' * 32}"
    for version in VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)


def test_checkpoint_claim_needs_an_absolute_checkpoint_dir() -> None:
    from deepfleet.controller.spec import SpecError

    with pytest.raises(SpecError, match=r"kubernetes\.checkpointClaim: .*absolute"):
        example_submission("kubernetes", kubernetes={"checkpointClaim": "c"}, checkpoint={"dir": "runs/x"})


def test_secret_references_become_secret_key_refs_to_the_users_secrets() -> None:
    sub = example_submission("kubernetes", env={"HF_TOKEN": {"secret": "hf", "key": "token"},
                                                "WANDB_API_KEY": {"secret": "wandb"}, "TEAM": "nlp"})
    job, secret, _ = manifests.render(sub, namespace="default", job_uid=JOB_UID)
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "wandb", "key": "value"}}
    assert json.loads(env["DEEPFLEET_WORKER_SPEC"]["value"])["env"] == {"TEAM": "nlp"}
    assert set(secret["stringData"]) == {TOKEN_ENV}  # the run's own Secret holds only the job token
    kubernetes_validate.validate(job, "1.33.0", strict=True)
