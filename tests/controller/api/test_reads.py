"""The read routes (GET /v1/jobs, GET /v1/jobs/{id}) answer from plain rows, serialized without building
their response models: the bytes must be exactly what the models give for the same jobs read as mapped
objects, over jobs in every state the detail shows. And the token cache: a token revoked in the
database stops working within `token_cache_s`, at once where it was revoked, and an expired one at once.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import select

from deepfleet.controller.api.principals import TokenCache
from deepfleet.controller.api.schemas import JobDetail, JobList, JobSummary
from deepfleet.controller.app import create_app
from deepfleet.controller.db.models import ApiToken, Attempt, Job
from deepfleet.controller.settings import Settings
from deepfleet.controller.tokens import job_token
from tests.controller.api.helpers import job_yaml, token, yaml_headers
from tests.controller.conftest import ADMIN_TOKEN

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
T0 = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=timezone.utc)


def _submit(client: TestClient, name: str, **replace: str) -> str:
    r = client.post("/v1/jobs", content=job_yaml(name=name, **replace), headers=yaml_headers(ADMIN))
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _jobs_in_every_state(client: TestClient, app, settings: Settings) -> list[str]:
    """Jobs whose details differ in every optional part: none, attempts with exit codes and times, a DP
    heartbeat, a registration, a serving endpoint, hidden env, extra and no labels, maxSteps."""
    plain = _submit(client, "plain")
    env = _submit(client, "with-env", **{"nodes: 2": "nodes: 2\n  maxSteps: 400\n  env: {TOKEN: abc, MODE: fast}"})
    labels = _submit(client, "labelled", **{"team: nlp": "team: nlp, tier: gold, 'example.com/owner': ana"})
    unlabelled = _submit(client, "unlabelled", **{"labels: {team: nlp}": "labels: {}"})
    running = _submit(client, "running")
    beat = {"step": 7, "loss": 2.5, "lr": 0.001, "tokens_per_s": 1234.5, "time": T0.isoformat()}
    assert client.post(f"/v1/jobs/{running}/heartbeat", json=beat, headers={
        "Authorization": f"Bearer {job_token(settings.secret.get_secret_value(), running)}"}).status_code == 200
    with app.state.sessions() as s:
        job = s.get(Job, running)
        job.phase, job.message, job.current_attempt, job.restart_counts = "RUNNING", "training", 1, {"node_lost": 1}
        job.last_heartbeat = {**job.last_heartbeat, "dp_epsilon": 1.5, "dp_delta": 1e-5, "dp_accountant": "rdp"}
        job.last_heartbeat_at, job.endpoint = T0, "http://10.0.0.7:8080"
        s.add_all([Attempt(job_id=running, number=0, backend="local", run_name=f"df-{running[:8]}-a0", phase="FAILED",
                           nodes=2, exit_codes={"0": 137, "1": 0}, failure_class="node_lost", message="node lost",
                           submitted_at=T0, started_at=T0 + timedelta(seconds=3), finished_at=T0 + timedelta(minutes=5)),
                   Attempt(job_id=running, number=1, backend="local", run_name=f"df-{running[:8]}-a1", phase="RUNNING",
                           nodes=None, exit_codes={}, message="", submitted_at=T0 + timedelta(minutes=6))])
        done = s.get(Job, plain)
        done.phase, done.finished_at, done.registration_state = "SUCCEEDED", T0 + timedelta(hours=1), "registered"
        done.registration = {"name": "gpt", "registry": "mlflow", "version": "3", "uri": "models:/gpt/3", "tries": 1,
                             "not_a_field": "dropped"}
        s.get(Job, env).desired_state = "cancel_requested"
        s.commit()
    return [plain, env, labels, unlabelled, running]


def test_a_job_detail_is_byte_for_byte_its_models_json(client, app, settings) -> None:
    for job_id in _jobs_in_every_state(client, app, settings):
        r = client.get(f"/v1/jobs/{job_id}", headers=ADMIN)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        with app.state.sessions() as s:
            expected = JobDetail.of(s.get(Job, job_id)).model_dump_json().encode()
        assert r.content == expected, job_id
    got = client.get(f"/v1/jobs/{job_id}", headers=ADMIN).json()
    assert [a["number"] for a in got["attempts"]] == [0, 1] and got["privacy"]["epsilon"] == 1.5
    assert client.get("/v1/jobs/" + "0" * 32, headers=ADMIN).json() == {
        "detail": f"job {'0' * 32} not found", "errors": []}


def test_a_listing_is_byte_for_byte_its_models_json(client, app, settings) -> None:
    ids = _jobs_in_every_state(client, app, settings)
    with app.state.sessions() as s:
        jobs = {j.id: j for j in s.scalars(select(Job).where(Job.id.in_(ids)))}
        newest_first = sorted(jobs.values(), key=lambda j: (j.created_at, j.id), reverse=True)
        summaries = [JobSummary.of(j) for j in newest_first]
    whole = client.get("/v1/jobs", headers=ADMIN)
    assert whole.content == JobList(items=summaries, total=5, next_cursor=None).model_dump_json().encode()
    first = client.get("/v1/jobs", params={"limit": 2}, headers=ADMIN)
    cursor = first.json()["next_cursor"]
    assert first.content == JobList(items=summaries[:2], total=5, next_cursor=cursor).model_dump_json().encode()
    second = client.get("/v1/jobs", params={"limit": 2, "cursor": cursor}, headers=ADMIN).json()
    assert [j["id"] for j in second["items"]] == [j.id for j in newest_first[2:4]]
    gold = client.get("/v1/jobs", params={"label": ["tier=gold", "team=nlp"], "phase": "PENDING"}, headers=ADMIN)
    assert [j["labels"] for j in gold.json()["items"]] == [{"team": "nlp", "tier": "gold", "example.com/owner": "ana"}]
    empty = client.get("/v1/jobs", params={"label": "tier=silver"}, headers=ADMIN)
    assert empty.content == b'{"items":[],"total":0,"next_cursor":null}'


def test_reads_on_the_embedded_sqlite_database(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, migrate_on_start=True, admin_token=ADMIN_TOKEN, admin_project="research")
    with TestClient(create_app(settings)) as client:
        ids = [_submit(client, f"job-{i}") for i in range(2)]
        ids.append(_submit(client, "labelled", **{"team: nlp": "team: nlp, tier: gold, 'example.com/owner': ana"}))
        unlabelled = _submit(client, "none", **{"labels: {team: nlp}": "labels: {}"})
        listed = client.get("/v1/jobs", params={"limit": 3}, headers=ADMIN)
        page = listed.json()
        assert [j["id"] for j in page["items"]] == [unlabelled, ids[2], ids[1]] and page["total"] == 4
        assert [list(j["labels"].items()) for j in page["items"]] == [
            [], [("example.com/owner", "ana"), ("team", "nlp"), ("tier", "gold")], [("team", "nlp")]]
        rest = client.get("/v1/jobs", params={"cursor": page["next_cursor"]}, headers=ADMIN).json()
        assert [j["id"] for j in rest["items"]] == [ids[0]]
        with client.app.state.sessions() as s:
            summaries = [JobSummary.of(s.get(Job, job_id)) for job_id in (unlabelled, ids[2], ids[1])]
            expected = JobDetail.of(s.get(Job, ids[2])).model_dump_json().encode()
        assert listed.content == JobList(items=summaries, total=4,
                                         next_cursor=page["next_cursor"]).model_dump_json().encode()
        assert client.get(f"/v1/jobs/{ids[2]}", headers=ADMIN).content == expected


def _revoke_in_the_database(app, headers: dict[str, str]) -> None:
    """As another API process (or an operator) would: the row changes, this process's cache does not."""
    token_id = headers["Authorization"].split("_")[1]
    with app.state.sessions() as s:
        s.get(ApiToken, token_id).revoked_at = datetime.now(timezone.utc)
        s.commit()


def test_a_token_revoked_elsewhere_stops_working_within_the_cache_time(client, app) -> None:
    now = [100.0]
    app.state.principals = TokenCache(5.0, clock=lambda: now[0])
    viewer = token(app, project="research", role="viewer")
    job_id = _submit(client, "job")
    assert client.get("/v1/jobs", headers=viewer).status_code == 200  # looked up, then trusted for 5 s
    _revoke_in_the_database(app, viewer)
    now[0] = 104.9
    assert client.get(f"/v1/jobs/{job_id}", headers=viewer).status_code == 200  # the documented window
    now[0] = 105.0
    for path in ("/v1/jobs", f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/events"):
        assert client.get(path, headers=viewer).status_code == 401, path
    # A wrong secret under a cached token's id is never taken for it.
    other = token(app, project="research", role="admin")
    assert client.get("/v1/jobs", headers=other).status_code == 200
    forged = {"Authorization": other["Authorization"][:-4] + "AAAA"}
    assert client.get("/v1/jobs", headers=forged).status_code == 401


def test_a_token_revoked_here_or_expired_stops_at_once(client, app) -> None:
    wall = [datetime.now(timezone.utc)]
    app.state.principals = TokenCache(300.0, now=lambda: wall[0])
    member = token(app, project="research", role="member")
    assert client.get("/v1/jobs", headers=member).status_code == 200
    token_id = member["Authorization"].split("_")[1]
    assert client.delete(f"/v1/tokens/{token_id}", headers=ADMIN).status_code == 204
    assert client.get("/v1/jobs", headers=member).status_code == 401
    brief = token(app, project="research", role="viewer", expires_at=wall[0] + timedelta(minutes=1))
    assert client.get("/v1/jobs", headers=brief).status_code == 200
    wall[0] += timedelta(minutes=1)
    assert client.get("/v1/jobs", headers=brief).status_code == 401


def test_a_zero_cache_time_looks_every_token_up(client, app) -> None:
    app.state.principals = TokenCache(0.0)
    viewer = token(app, project="research", role="viewer")
    assert client.get("/v1/jobs", headers=viewer).status_code == 200
    _revoke_in_the_database(app, viewer)
    assert client.get("/v1/jobs", headers=viewer).status_code == 401
