"""The secret store over the API (PostgreSQL) and secret references at submit: an admin sets values that
no answer, event or error body ever shows again; members list names; the database keeps ciphertext;
references a project may not make are refused with a 422 and one line naming the field."""

from __future__ import annotations

import json
import textwrap

import pytest
from sqlalchemy import select, text

from deepfleet.controller.app import create_app
from deepfleet.controller.db.models import StoredSecret
from deepfleet.controller.settings import Settings
from tests.controller.api.helpers import job_yaml, token, yaml_headers
from tests.controller.conftest import ADMIN_TOKEN, TestClient

VALUE = "wandb-key-3c1f9e0a7b2d"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
LOCAL_REF = "  env: {WANDB_API_KEY: {secret: wandb}, TEAM: nlp}\n"


def _put(client, name: str, value: str, auth=ADMIN):
    return client.put(f"/v1/secrets/{name}", json={"value": value}, headers=auth)


def test_an_admin_sets_and_a_member_lists_names_never_values(client, app) -> None:
    created = _put(client, "wandb", VALUE)
    assert created.status_code == 201 and VALUE not in created.text
    assert set(created.json()) == {"name", "created_at", "updated_at", "updated_by"}
    assert _put(client, "wandb", VALUE + "2").status_code == 200  # replaced
    member = token(app, project="research", role="member")
    listed = client.get("/v1/secrets", headers=member)
    assert listed.status_code == 200 and [s["name"] for s in listed.json()["items"]] == ["wandb"]
    assert VALUE not in listed.text
    # Other projects see nothing of it.
    other = token(app, project="other", role="admin")
    assert client.get("/v1/secrets", headers=other).json()["items"] == []
    assert client.delete("/v1/secrets/wandb", headers=other).status_code == 404
    # Only ciphertext in the database.
    with app.state.sessions() as s:
        (row,) = s.scalars(select(StoredSecret)).all()
        assert VALUE not in row.ciphertext and row.project == "research"
        dump = json.dumps([list(r) for r in s.execute(text("SELECT * FROM secrets"))], default=str)
        assert VALUE not in dump


def test_only_admins_write_and_errors_never_echo_the_value(client, app) -> None:
    member = token(app, project="research", role="member")
    refused = _put(client, "wandb", VALUE, auth=member)
    assert refused.status_code == 403 and VALUE not in refused.text
    viewer = token(app, project="research", role="viewer")
    assert client.get("/v1/secrets", headers=viewer).status_code == 403
    too_long = _put(client, "big", VALUE * 5000)  # past the request body limit
    assert too_long.status_code == 413 and VALUE not in too_long.text
    assert _put(client, "empty", "").json()["errors"] == [
        "body.value: Value should have at least 1 item after validation, not 0; fix the value"]
    wrong_type = client.put("/v1/secrets/x", json={"value": {"nested": VALUE}}, headers=ADMIN)
    assert wrong_type.status_code == 422 and VALUE not in wrong_type.text
    extra = client.put("/v1/secrets/x", json={"value": VALUE, "echo": VALUE}, headers=ADMIN)
    assert extra.status_code == 422 and VALUE not in extra.text
    bad_name = _put(client, "Not_A_Label", VALUE)
    assert bad_name.status_code == 422 and VALUE not in bad_name.text
    assert client.delete("/v1/secrets/none", headers=ADMIN).status_code == 404


def test_a_local_job_may_reference_only_its_projects_secrets(client, app) -> None:
    member = token(app, project="research", role="member")
    body = job_yaml() + LOCAL_REF
    missing = client.post("/v1/jobs", content=body, headers=yaml_headers(member))
    assert missing.status_code == 422
    assert missing.json()["errors"] == [
        "spec.env.WANDB_API_KEY.secret: secret 'wandb' is not in project 'research''s secret store; set it "
        "with `deepfleet secret set wandb` or drop the reference"]
    assert _put(client, "wandb", VALUE).status_code == 201
    ok = client.post("/v1/jobs", content=body, headers=yaml_headers(member))
    assert ok.status_code == 201, ok.text
    job = ok.json()
    assert job["spec"]["spec"]["env"] == {"WANDB_API_KEY": {"secret": "wandb"}, "TEAM": "(hidden)"}
    seen = [ok.text, client.get(f"/v1/jobs/{job['id']}", headers=member).text,
            client.get(f"/v1/jobs/{job['id']}/events", headers=member).text, client.get("/metrics").text]
    assert not any(VALUE in s for s in seen)


@pytest.mark.parametrize(("env", "error"), [
    ("{K: {secret: wandb, key: api-key}}", "spec.env.K.key: only applies to backend kubernetes"),
    ("{K: {secret: Bad_Name}}", "spec.env.K.secret: must be a DNS-1123 label"),
    ("{K: {secret: wandb, name: x}}", "spec.env.K.name: unknown field"),
    ("{K: [a]}", "spec.env.K: Input should be a valid string"),
])
def test_malformed_references_are_one_line_each(client, app, env: str, error: str) -> None:
    member = token(app, project="research", role="member")
    r = client.post("/v1/jobs", content=job_yaml() + f"  env: {env}\n", headers=yaml_headers(member))
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert len(errors) == 1 and errors[0].startswith(error), errors


K8S = textwrap.dedent("""
    apiVersion: deepfleet/v1
    kind: TrainingJob
    metadata: {name: k, project: research}
    spec:
      backend: kubernetes
      image: ghcr.io/acme/worker:1
      entrypoint: {script: train.py}
      env: {HF_TOKEN: {secret: hf, key: token}}
""")


def test_cluster_secret_references_follow_the_projects_policy(settings: Settings, tmp_path) -> None:
    refused_app = create_app(settings.model_copy(update={"backends": ["kubernetes", "azureml"]}))
    with TestClient(refused_app) as client:
        auth = token(refused_app, project="research", role="member")
        r = client.post("/v1/jobs", content=K8S, headers=yaml_headers(auth))
        assert r.status_code == 422 and r.json()["errors"] == [
            "spec.env.HF_TOKEN.secret: secret 'hf' is not allowed for this project (allowed: none); drop it or "
            "ask an admin to allow it"]
    policy = tmp_path / "policy.yaml"
    policy.write_text("research: {secrets: [hf]}\n")
    app = create_app(settings.model_copy(update={"policy_file": policy, "backends": ["kubernetes", "azureml"]}))
    with TestClient(app) as client:
        auth = token(app, project="research", role="member")
        assert client.post("/v1/jobs", content=K8S, headers=yaml_headers(auth)).status_code == 201
        azure = K8S.replace("backend: kubernetes", "backend: azureml\n  azureml: {compute: gpu}").replace(
            ", key: token", "")
        assert client.post("/v1/jobs", content=azure, headers=yaml_headers(auth)).status_code == 201
        other = client.post("/v1/jobs", content=K8S.replace("secret: hf", "secret: db-admin"),
                            headers=yaml_headers(auth))
        assert other.status_code == 422 and other.json()["errors"][0].startswith(
            "spec.env.HF_TOKEN.secret: secret 'db-admin' is not allowed for this project (allowed: hf)")
