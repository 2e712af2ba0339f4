"""The /v1 API against a real PostgreSQL: submit, list/filter/paginate, get, cancel, events,
heartbeats and metrics, logs (tail and follow), tokens, health and Prometheus metrics."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from deepfleet.controller.db.models import Attempt, Job
from deepfleet.controller.tokens import job_token
from tests.controller.api.helpers import job_yaml, token, yaml_headers
from tests.controller.conftest import ADMIN_TOKEN

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def submit(client, auth=ADMIN, **kw) -> dict:
    r = client.post("/v1/jobs", content=job_yaml(**kw), headers=yaml_headers(auth))
    assert r.status_code == 201, r.text
    return r.json()


def test_submit_yaml_and_get(client) -> None:
    job = submit(client)
    assert job["phase"] == "PENDING" and job["desired_state"] == "run"
    assert job["world_size"] == 2 and job["labels"] == {"team": "nlp"} and job["project"] == "research"
    assert job["spec"]["spec"]["entrypoint"]["script"] == "examples/gpt/train.py"
    got = client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()
    assert got["id"] == job["id"] and got["spec"] == job["spec"] and got["attempts"] == []
    events = client.get(f"/v1/jobs/{job['id']}/events", headers=ADMIN).json()["items"]
    assert [(e["type"], e["actor"]) for e in events] == [("Submitted", "token:0123456789ab")]


def test_submit_json(client) -> None:
    import yaml

    document = yaml.safe_load(job_yaml(name="from-json"))
    r = client.post("/v1/jobs", content=json.dumps(document), headers={**ADMIN, "Content-Type": "application/json"})
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "from-json"


def test_list_filters_and_paginates(client, app) -> None:
    ids = [submit(client, name=f"job-{i}")["id"] for i in range(5)]
    other = submit(client, name="other", **{"team: nlp": "team: vision"})["id"]
    with app.state.sessions() as session:
        session.get(Job, ids[0]).phase = "RUNNING"
        session.commit()
    everything = client.get("/v1/jobs", headers=ADMIN).json()
    assert everything["total"] == 6 and [j["id"] for j in everything["items"]] == [other, *reversed(ids)]
    assert [j["id"] for j in client.get("/v1/jobs?phase=RUNNING", headers=ADMIN).json()["items"]] == [ids[0]]
    assert [j["id"] for j in client.get("/v1/jobs?label=team=vision", headers=ADMIN).json()["items"]] == [other]
    assert client.get("/v1/jobs?queue=default&project=research", headers=ADMIN).json()["total"] == 6
    assert client.get("/v1/jobs?queue=nope", headers=ADMIN).json()["total"] == 0
    seen, cursor = [], None
    while True:
        page = client.get("/v1/jobs", params={"limit": 4, **({"cursor": cursor} if cursor else {})}, headers=ADMIN).json()
        seen += [j["id"] for j in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [other, *reversed(ids)]
    bad = client.get("/v1/jobs?cursor=garbage", headers=ADMIN)
    assert bad.status_code == 422 and bad.json()["errors"][0].startswith("query.cursor:")
    bad = client.get("/v1/jobs?phase=DONE", headers=ADMIN)
    assert bad.status_code == 422 and bad.json()["errors"][0].startswith("query.phase:")


def test_cancel_records_intent_and_event(client, app) -> None:
    job = submit(client)
    r = client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    assert r.status_code == 202 and r.json()["desired_state"] == "cancel_requested"
    assert r.json()["phase"] == "PENDING"  # the API records intent; the reconciler acts
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN).status_code == 202  # idempotent
    types = [e["type"] for e in client.get(f"/v1/jobs/{job['id']}/events", headers=ADMIN).json()["items"]]
    assert types == ["Submitted", "CancelRequested"]
    with app.state.sessions() as session:
        session.get(Job, job["id"]).phase = "SUCCEEDED"
        session.commit()
    done = client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    assert done.status_code == 409 and "already finished" in done.json()["detail"]


def test_heartbeats_with_the_job_token_become_metrics(client, settings) -> None:
    job = submit(client)
    worker = {"Authorization": f"Bearer {job_token(settings.secret.get_secret_value(), job['id'])}"}
    for step in (10, 20):
        r = client.post(f"/v1/jobs/{job['id']}/heartbeat", headers=worker,
                        json={"step": step, "loss": 3.0 - step / 10, "tokens_per_s": 1000.0,
                              "last_complete_checkpoint": "global_step20" if step == 20 else None})
        assert r.status_code == 200 and r.json() == {"desired_state": "run"}
    points = client.get(f"/v1/jobs/{job['id']}/metrics", headers=ADMIN).json()["points"]
    assert [(p["step"], p["loss"]) for p in points] == [(10, 2.0), (20, 1.0)]
    detail = client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()
    assert detail["last_heartbeat"]["step"] == 20 and detail["last_heartbeat_at"]
    # the job list carries the step too (the web page's Step column)
    (listed,) = [j for j in client.get("/v1/jobs", headers=ADMIN).json()["items"] if j["id"] == job["id"]]
    assert listed["step"] == 20 and listed["max_steps"] is None
    # both figures come from the JSON documents in SQL, as the detail reads them
    capped = submit(client, name="capped", **{"backend: local": "backend: local\n  maxSteps: 40"})
    (listed,) = [j for j in client.get("/v1/jobs", headers=ADMIN).json()["items"] if j["id"] == capped["id"]]
    assert listed["max_steps"] == 40 and listed["step"] is None
    types = [e["type"] for e in client.get(f"/v1/jobs/{job['id']}/events", headers=ADMIN).json()["items"]]
    assert types == ["Submitted", "CheckpointSaved"]
    r = client.post(f"/v1/jobs/{job['id']}/failure", headers=worker,
                    json={"rank": 1, "class": "oom", "message": "CUDA out of memory"})
    assert r.status_code == 202
    last = client.get(f"/v1/jobs/{job['id']}/events", headers=ADMIN).json()["items"][-1]
    assert last["type"] == "WorkerFailed" and last["actor"] == "worker:1" and "oom" in last["message"]
    # A job token is worth nothing for another job or for the user API.
    other = submit(client, name="other")
    assert client.post(f"/v1/jobs/{other['id']}/heartbeat", headers=worker, json={"step": 1}).status_code == 401
    assert client.get(f"/v1/jobs/{job['id']}", headers=worker).status_code == 401
    bad = client.post(f"/v1/jobs/{job['id']}/heartbeat", headers=worker, json={"step": -1, "extra": 1})
    assert bad.status_code == 422 and {e.split(":")[0] for e in bad.json()["errors"]} == {"body.step", "body.extra"}


def test_a_dp_jobs_epsilon_is_in_its_record_and_its_metrics(client, settings) -> None:
    job = submit(client)
    worker = {"Authorization": f"Bearer {job_token(settings.secret.get_secret_value(), job['id'])}"}
    plain = client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()
    assert plain["privacy"] is None and plain["registration"] is None
    for step, eps in ((5, 0.8), (10, 1.3)):
        r = client.post(f"/v1/jobs/{job['id']}/heartbeat", headers=worker,
                        json={"step": step, "loss": 1.0, "dp_epsilon": eps, "dp_delta": 1e-5, "dp_accountant": "prv"})
        assert r.status_code == 200, r.text
    detail = client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()
    assert detail["privacy"] == {"epsilon": 1.3, "delta": 1e-5, "accountant": "prv", "step": 10}
    points = client.get(f"/v1/jobs/{job['id']}/metrics", headers=ADMIN).json()["points"]
    assert [(p["step"], p["dp_epsilon"], p["dp_delta"]) for p in points] == [(5, 0.8, 1e-5), (10, 1.3, 1e-5)]
    bad = client.post(f"/v1/jobs/{job['id']}/heartbeat", headers=worker, json={"step": 11, "dp_accountant": "gdp"})
    assert bad.status_code == 422


def _add_attempt(app, job_id: str, run_name: str) -> None:
    with app.state.sessions() as session:
        session.add(Attempt(job_id=job_id, number=0, backend="local", run_name=run_name, phase="RUNNING"))
        session.get(Job, job_id).phase = "RUNNING"
        session.commit()


def test_logs_tail_and_follow(client, app, settings) -> None:
    job = submit(client)
    assert client.get(f"/v1/jobs/{job['id']}/logs", headers=ADMIN).status_code == 404  # not started
    run = f"df-gpt-small-{job['id'][:8]}-a0"
    _add_attempt(app, job["id"], run)
    log = Path(settings.logs_root) / run / "node-1.log"
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    r = client.get(f"/v1/jobs/{job['id']}/logs", params={"node": 1, "tail": 3}, headers=ADMIN)
    assert r.status_code == 200 and r.text == "line 997\nline 998\nline 999\n"
    assert client.get(f"/v1/jobs/{job['id']}/logs", params={"node": 1}, headers=ADMIN).text.count("\n") == 1000

    def finish_later() -> None:
        time.sleep(0.3)
        with log.open("a") as f:
            f.write("final line\n")
        with app.state.sessions() as session:
            session.get(Job, job["id"]).phase = "SUCCEEDED"
            session.commit()

    writer = threading.Thread(target=finish_later)
    writer.start()
    with client.stream("GET", f"/v1/jobs/{job['id']}/logs", params={"node": 1, "tail": 1, "follow": True},
                       headers=ADMIN) as stream:
        body = "".join(stream.iter_text())
    writer.join()
    assert body == "line 999\nfinal line\n"


def test_tokens_endpoint_and_roles(client, app) -> None:
    r = client.post("/v1/tokens", json={"name": "ci", "role": "viewer", "expires_in_days": 1}, headers=ADMIN)
    assert r.status_code == 201, r.text
    viewer = {"Authorization": f"Bearer {r.json()['token']}"}
    assert r.json()["project"] == "research" and r.json()["expires_at"]
    assert client.get("/v1/jobs", headers=viewer).status_code == 200
    assert client.post("/v1/tokens", json={"name": "x"}, headers=viewer).status_code == 403
    other = client.post("/v1/tokens", json={"name": "x", "project": "vision"}, headers=ADMIN)
    assert other.status_code == 403 and other.json()["errors"][0].startswith("project:")
    assert client.delete(f"/v1/tokens/{r.json()['id']}", headers=token(app, project="vision", role="admin")
                         ).status_code == 404  # another project's token is not there for it
    assert client.delete(f"/v1/tokens/{r.json()['id']}", headers=ADMIN).status_code == 204
    assert client.get("/v1/jobs", headers=viewer).status_code == 401  # revoked
    extra = client.post("/v1/tokens", json={"name": "x", "scope": "all"}, headers=ADMIN)
    assert extra.status_code == 422 and extra.json()["errors"][0].startswith("body.scope:")


def test_health_ready_and_prometheus(client) -> None:
    submit(client)
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json() == {"status": "ok"}
    text = client.get("/metrics").text
    assert 'deepfleet_jobs{phase="PENDING"} 1.0' in text
    assert 'deepfleet_http_request_duration_seconds_count{method="POST",route="/v1/jobs",status="201"} 1.0' in text


def test_queues_are_listed_and_set_by_operator_admins(client, app) -> None:
    assert client.get("/v1/queues", headers=ADMIN).json() == [{"name": "default", "max_processes": None,
                                                                "max_gpus": None}]
    r = client.put("/v1/queues/gold", json={"max_processes": 8, "max_gpus": 4}, headers=ADMIN)
    assert r.status_code == 200 and r.json() == {"name": "gold", "max_processes": 8, "max_gpus": 4}
    job = submit(client, **{"nodes: 2": "nodes: 2\n  queue: gold"})
    assert job["queue"] == "gold"
    other_admin = token(app, project="vision", role="admin")
    assert client.put("/v1/queues/gold", json={"max_processes": 1}, headers=other_admin).status_code == 403
    member = token(app, project="research", role="member")
    assert client.put("/v1/queues/gold", json={"max_processes": 1}, headers=member).status_code == 403
    assert client.get("/v1/queues", headers=member).status_code == 200
    assert client.put("/v1/queues/Gold!", json={}, headers=ADMIN).status_code == 422
