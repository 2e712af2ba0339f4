"""The attacks an ordinary member token tried, each now refused at submit with a 422 and one short line per
reason (on PostgreSQL): factories naming the interpreter, files the server would read, paths out of the
job's area, cluster resources outside the project's policy, alias bombs and oversized documents; and
what a job's readers and finished jobs can no longer do."""

from __future__ import annotations

import json
import os
import stat
import textwrap

import pytest

from deepfleet.controller.app import create_app
from deepfleet.controller.db.models import Job
from deepfleet.controller.settings import Settings
from deepfleet.controller.tokens import job_token
from tests.controller.api.helpers import job_yaml, token, yaml_headers
from tests.controller.conftest import ADMIN_TOKEN, TestClient

SCRIPT = "entrypoint: {script: examples/gpt/train.py, args: [\"--steps\", \"50\"]}"


def refused(client, auth, body: str, *, content_type: str = "application/yaml") -> list[str]:
    r = client.post("/v1/jobs", content=body, headers={**auth, "Content-Type": content_type})
    assert r.status_code == 422, r.text
    assert len(r.content) < 8192, len(r.content)  # never the input back at size
    return r.json()["errors"]


@pytest.fixture()
def member(app) -> dict[str, str]:
    return token(app, project="research", role="member")


def test_a_factory_cannot_name_the_interpreter_or_deepfleet(client, member) -> None:
    for factory in ("os:system", "subprocess:run", "builtins:exec", "deepfleet.controller.server:main"):
        errors = refused(client, member, job_yaml(**{SCRIPT: f"entrypoint: {{factory: \"{factory}\"}}\n  maxSteps: 5"}))
        assert len(errors) == 1 and errors[0].startswith("spec.entrypoint.factory: ") and "not the job's own" \
            in errors[0], errors


def test_the_server_reads_no_file_named_in_a_spec(client, member) -> None:
    errors = refused(client, member, job_yaml() + "  engine: /etc/passwd\n")
    assert errors == ["spec.engine: the server reads no files named in a spec; put the engine config inline "
                      "(`deepfleet submit` inlines the file it names)"]
    assert "root:" not in json.dumps(errors)


@pytest.mark.parametrize(("line", "field"), [
    ("  checkpoint: {dir: /srv/alpha/checkpoints}\n", "spec.checkpoint.dir"),
    ("  checkpoint: {dir: ../../alpha/checkpoints}\n", "spec.checkpoint.dir"),
    ("  checkpoint: {dir: ~/ck}\n", "spec.checkpoint.dir"),
])
def test_local_paths_stay_inside_the_jobs_own_area(client, member, line: str, field: str) -> None:
    errors = refused(client, member, job_yaml() + line)
    assert len(errors) == 1 and errors[0].startswith(field + ": "), errors


@pytest.mark.parametrize("script", ["/etc/passwd", "../../../etc/passwd"])
def test_a_script_path_cannot_leave_the_projects_code(client, member, script: str) -> None:
    errors = refused(client, member, job_yaml(**{"examples/gpt/train.py": script}))
    assert len(errors) == 1 and errors[0].startswith("spec.entrypoint.script: "), errors


K8S = textwrap.dedent("""
    apiVersion: deepfleet/v1
    kind: TrainingJob
    metadata: {name: k, project: research}
    spec:
      backend: kubernetes
      image: ghcr.io/acme/worker:1
      entrypoint: {script: train.py}
      kubernetes: {OPTION}
""")


@pytest.mark.parametrize(("option", "field"), [
    ("{namespace: kube-system}", "spec.kubernetes.namespace"),
    ("{serviceAccountName: deepfleet-controller}", "spec.kubernetes.serviceAccountName"),
    ("{priorityClassName: system-node-critical}", "spec.kubernetes.priorityClassName"),
    ("{checkpointClaim: alpha-ckpt}", "spec.kubernetes.checkpointClaim"),
    ("{nodeSelector: {node-role.kubernetes.io/control-plane: ''}}",
     "spec.kubernetes.nodeSelector.node-role.kubernetes.io/control-plane"),
    ("{tolerations: [{operator: Exists}]}", "spec.kubernetes.tolerations"),
])
def test_cluster_resources_outside_the_projects_policy_are_refused(client, member, option: str, field: str) -> None:
    body = K8S.replace("{OPTION}", option)
    if "checkpointClaim" in option:
        body += "  checkpoint: {dir: /ck}\n"
    errors = refused(client, member, body)
    assert len(errors) == 1 and errors[0].startswith(field + ": ") and "allowed" in errors[0], errors


def test_an_admin_policy_file_allows_named_resources(settings: Settings, tmp_path) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text("research: {namespaces: [research-jobs], priorityClasses: [training]}\n"
                      .replace("priorityClasses", "priority_classes"))
    app = create_app(settings.model_copy(update={"policy_file": policy, "backends": ["kubernetes"]}))
    with TestClient(app) as client:
        auth = token(app, project="research", role="member")
        ok = K8S.replace("{OPTION}", "{namespace: research-jobs, priorityClassName: training}")
        r = client.post("/v1/jobs", content=ok, headers=yaml_headers(auth))
        assert r.status_code == 201, r.text
        errors = refused(client, auth, K8S.replace("{OPTION}", "{namespace: kube-system}"))
        assert errors[0].startswith("spec.kubernetes.namespace: namespace 'kube-system' is not allowed "
                                    "for this project (allowed: default, research-jobs)")


def test_an_alias_bomb_is_refused_before_it_is_built(client, member) -> None:
    rows = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    rows += [f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]" for i in range(8)]
    bomb = "\n".join(rows) + "\n"
    assert len(bomb) < 500
    assert refused(client, member, bomb) == ["(document): more than 64 aliases; a job spec is far smaller, shorten it"]


def test_huge_and_deep_documents_get_one_short_line(client, member) -> None:
    wide = {"apiVersion": "deepfleet/v1", "kind": "TrainingJob", "metadata": {"name": "w", "project": "research"},
            "spec": {"entrypoint": {"script": "t.py"}, "engine": {f"k{i}": i for i in range(3000)}}}
    assert refused(client, member, json.dumps(wide), content_type="application/json") == [
        "(document): more than 5000 values; a job spec is far smaller, shorten it"]
    deep = "[" * 5000 + "]" * 5000
    errors = refused(client, member, deep, content_type="application/json")
    assert len(errors) == 1 and "levels of nesting" in errors[0]
    unknown = {**wide, "spec": {"entrypoint": {"script": "t.py"}, "engine": {f"k{i}": i for i in range(1000)}}}
    errors = refused(client, member, json.dumps(unknown), content_type="application/json")
    assert len(errors) <= 21 and all(len(e) <= 300 for e in errors)


def test_env_values_are_never_echoed(client, app, member) -> None:
    body = job_yaml() + "  env: {HF_TOKEN: hf_secret_value_123}\n"
    r = client.post("/v1/jobs", content=body, headers=yaml_headers(member))
    assert r.status_code == 201 and "hf_secret_value_123" not in r.text
    viewer = token(app, project="research", role="viewer")
    got = client.get(f"/v1/jobs/{r.json()['id']}", headers=viewer)
    assert got.json()["spec"]["spec"]["env"] == {"HF_TOKEN": "(hidden)"}
    for path in ("", "/events"):
        assert "hf_secret_value_123" not in client.get(f"/v1/jobs/{r.json()['id']}{path}", headers=viewer).text
    assert "hf_secret_value_123" not in client.get("/v1/jobs", headers=viewer).text


def test_resume_from_names_a_job_of_the_same_project_only(client, app, member) -> None:
    other = client.post("/v1/jobs", content=job_yaml(project="vision"),
                        headers=yaml_headers(token(app, project="vision", role="member"))).json()["id"]
    errors = refused(client, member, job_yaml() + f"  checkpoint: {{dir: ck, resumeFrom: {other}}}\n")
    assert errors == [f"spec.checkpoint.resumeFrom: no job {other!r} in project 'research'; name a job of this project"]
    own = client.post("/v1/jobs", content=job_yaml(), headers=yaml_headers(member)).json()["id"]
    r = client.post("/v1/jobs", content=job_yaml() + f"  checkpoint: {{dir: ck, resumeFrom: {own}}}\n",
                    headers=yaml_headers(member))
    assert r.status_code == 201, r.text


def test_a_finished_jobs_token_has_expired(client, app, member, settings: Settings) -> None:
    job_id = client.post("/v1/jobs", content=job_yaml(), headers=yaml_headers(member)).json()["id"]
    worker = {"Authorization": f"Bearer {job_token(settings.secret.get_secret_value(), job_id)}"}
    assert client.post(f"/v1/jobs/{job_id}/heartbeat", json={"step": 1}, headers=worker).status_code == 200
    with app.state.sessions() as session:
        session.get(Job, job_id).phase = "SUCCEEDED"
        session.commit()
    r = client.post(f"/v1/jobs/{job_id}/heartbeat", json={"step": 2}, headers=worker)
    assert r.status_code == 401 and "expired" in r.json()["detail"]


def test_a_revoked_bootstrap_token_stays_revoked_after_a_restart(settings: Settings) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    app = create_app(settings)
    with TestClient(app) as client:
        assert client.get("/v1/jobs", headers=admin).status_code == 200
        token_id = ADMIN_TOKEN.split("_")[1]
        assert client.delete(f"/v1/tokens/{token_id}", headers=admin).status_code in (200, 204)
    app = create_app(settings)  # a restart: the bootstrap token is ensured again
    with TestClient(app) as client:
        assert client.get("/v1/jobs", headers=admin).status_code == 401


def test_the_embedded_database_file_is_owner_only(tmp_path) -> None:
    settings = Settings(data_dir=tmp_path, migrate_on_start=True, secret="s")
    with TestClient(create_app(settings)):
        pass
    mode = stat.S_IMODE(os.stat(tmp_path / "deepfleet.db").st_mode)
    assert mode == 0o600, oct(mode)
