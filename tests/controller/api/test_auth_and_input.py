"""Isolation between projects, roles, bad tokens, and bad input: every refusal is a 4xx that names the
field and the fix."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from deepfleet.controller.db.models import Attempt
from tests.controller.api.helpers import job_yaml, token, yaml_headers


@pytest.fixture()
def b_job(client, app) -> str:
    """A job of project "vision" (with an attempt, so it has logs) submitted by vision's member."""
    member_b = token(app, project="vision", role="member")
    r = client.post("/v1/jobs", content=job_yaml(project="vision"), headers=yaml_headers(member_b))
    assert r.status_code == 201, r.text
    with app.state.sessions() as session:
        session.add(Attempt(job_id=r.json()["id"], number=0, backend="local", run_name="df-x-a0", phase="RUNNING"))
        session.commit()
    return r.json()["id"]


def test_a_token_never_sees_another_projects_job(client, app, b_job: str) -> None:
    a = token(app, project="research", role="admin")
    for method, path in [("GET", ""), ("GET", "/events"), ("GET", "/logs"), ("GET", "/metrics"),
                         ("POST", "/cancel"), ("POST", "/heartbeat")]:
        kwargs = {"json": {"step": 1}} if path == "/heartbeat" else {}
        r = client.request(method, f"/v1/jobs/{b_job}{path}", headers=a, **kwargs)
        assert r.status_code == 404, (method, path, r.status_code, r.text)
        assert r.json()["detail"] == f"job {b_job} not found"  # same answer as for an id that does not exist
    assert client.get("/v1/jobs", headers=a).json()["total"] == 0
    assert client.get("/v1/jobs?project=vision", headers=a).json() == {"items": [], "total": 0, "next_cursor": None}
    b = token(app, project="vision", role="viewer")
    assert client.get(f"/v1/jobs/{b_job}", headers=b).status_code == 200


def test_submitting_into_another_project_is_refused(client, app) -> None:
    a = token(app, project="research", role="member")
    r = client.post("/v1/jobs", content=job_yaml(project="vision"), headers=yaml_headers(a))
    assert r.status_code == 403 and r.json()["errors"][0].startswith("metadata.project: this token belongs to")


def test_viewer_reads_but_cannot_submit_or_cancel(client, app, b_job: str) -> None:
    viewer = token(app, project="vision", role="viewer")
    r = client.post("/v1/jobs", content=job_yaml(project="vision"), headers=yaml_headers(viewer))
    assert r.status_code == 403 and "viewer cannot submit" in r.json()["detail"]
    assert client.post(f"/v1/jobs/{b_job}/cancel", headers=viewer).status_code == 403
    assert client.get(f"/v1/jobs/{b_job}/events", headers=viewer).status_code == 200
    assert client.post(f"/v1/jobs/{b_job}/heartbeat", headers=viewer, json={"step": 1}).status_code == 403


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer nonsense", "Basic dXNlcjpwYXNz", "Bearer dft_0123456789ab_" + "x" * 32,
     "Bearer dfj_" + "0" * 40],
)
def test_missing_or_invalid_tokens_get_401(client, authorization) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    r = client.get("/v1/jobs", headers=headers)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"


def test_expired_token_gets_401(client, app) -> None:
    expired = token(app, project="research", role="admin", expires_at=datetime.now(timezone.utc) - timedelta(seconds=1))
    assert client.get("/v1/jobs", headers=expired).status_code == 401
    live = token(app, project="research", role="admin", expires_at=datetime.now(timezone.utc) + timedelta(hours=1))
    assert client.get("/v1/jobs", headers=live).status_code == 200


@pytest.mark.parametrize(
    ("body", "content_type", "status", "first_error"),
    [
        ("apiVersion: [deepfleet/v1\n", "application/yaml", 422, "(document): malformed YAML at line 2"),
        (job_yaml(**{"nodes: 2": "nodes: 2\n  gpus: 4"}), "application/yaml", 422, "spec.gpus: unknown field"),
        (job_yaml(**{"nodes: 2": "nodes: 0"}), "application/yaml", 422, "spec.nodes: Input should be greater"),
        (job_yaml(**{"backend: local": "backend: kubernetes\n  image: img:1"}), "application/yaml", 422,
         "spec.backend: this controller runs local jobs, not kubernetes"),
        (job_yaml(**{"nodes: 2": "nodes: 2\n  queue: gold"}), "application/yaml", 422,
         "spec.queue: queue 'gold' does not exist; use one of default"),
        ("{not json", "application/json", 422, "(document): malformed JSON at line 1"),
        ("[1, 2]", "application/json", 422, "(document): expected a mapping"),
        ("<job/>", "application/xml", 415, None),
        (b"\xff\xfe", "application/yaml", 400, None),
    ],
)
def test_bad_job_documents(client, app, body, content_type, status, first_error) -> None:
    member = token(app, project="research", role="member")
    r = client.post("/v1/jobs", content=body, headers={**member, "Content-Type": content_type})
    assert r.status_code == status, r.text
    if first_error:
        assert r.json()["errors"][0].startswith(first_error), r.json()


def test_invalid_engine_config_inside_the_spec(client, app) -> None:
    pytest.importorskip("deepfleet.engine.config")
    member = token(app, project="research", role="member")
    text = job_yaml(**{"nodes: 2": "nodes: 2\n  engine: {train_batch_size: 4, zero_optimisation: {stage: 2}}"})
    r = client.post("/v1/jobs", content=text, headers=yaml_headers(member))
    assert r.status_code == 422
    assert any(e.startswith("spec.engine.") and "zero_optimisation" in e for e in r.json()["errors"]), r.json()


def test_oversize_bodies_get_413(client, app) -> None:
    member = token(app, project="research", role="member")
    big = job_yaml() + "# " + "x" * (70 * 1024) + "\n"
    r = client.post("/v1/jobs", content=big, headers=yaml_headers(member))
    assert r.status_code == 413 and r.json()["detail"] == "request body too large"

    def chunks():
        for _ in range(70):
            yield b"#" * 1024 + b"\n"

    r = client.post("/v1/jobs", content=chunks(), headers=yaml_headers(member))  # chunked: no Content-Length
    assert r.status_code == 413
