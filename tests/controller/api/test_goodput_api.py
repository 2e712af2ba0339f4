"""Goodput through the API and /metrics against a real PostgreSQL: a job with an injected restart
(two attempts, heartbeats with their own times) reports the hand-computed goodput, lost time by cause,
MFU, tokens/s and ETA; /metrics carries per-job gauges for unfinished jobs only."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from deepfleet.controller.db.models import Attempt, Job
from deepfleet.controller.tokens import job_token
from tests.controller.api.test_jobs import ADMIN, submit

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def inject_restarted_job(client, app, settings, *, finished: bool) -> str:
    job = submit(client, **{"nodes: 2": "nodes: 2\n  maxSteps: 1000"})
    with app.state.sessions() as session:
        row = session.get(Job, job["id"])
        row.created_at, row.phase = T0, "SUCCEEDED" if finished else "RUNNING"
        row.finished_at = at(402) if finished else None
        session.add(Attempt(job_id=row.id, number=1, backend="local", run_name="a1", phase="FAILED",
                            submitted_at=at(10), started_at=at(15), finished_at=at(135)))
        session.add(Attempt(job_id=row.id, number=2, backend="local", run_name="a2",
                            phase="SUCCEEDED" if finished else "RUNNING", submitted_at=at(165), started_at=at(170),
                            finished_at=at(400) if finished else None))
        row.current_attempt = 1
        session.commit()
    worker = {"Authorization": f"Bearer {job_token(settings.secret.get_secret_value(), job['id'])}"}
    beats = [(1, 35, 10, None, 0.0), (1, 65, 50, None, 0.0), (1, 95, 100, "ckpt-100", 4.0),
             (1, 125, 140, "ckpt-100", 4.0), (2, 190, 110, "ckpt-100", 0.0), (2, 300, 250, "ckpt-200", 6.0),
             (2, 390, 400, None, 6.0)]
    for attempt, t, step, ckpt, stall in beats:
        with app.state.sessions() as session:
            session.get(Job, job["id"]).current_attempt = attempt
            session.get(Job, job["id"]).phase = "RUNNING"
            session.commit()
        r = client.post(f"/v1/jobs/{job['id']}/heartbeat", headers=worker, json={
            "step": step, "loss": 1.0, "tokens_per_s": 5000.0, "mfu": 0.41, "checkpoint_s": stall,
            "last_complete_checkpoint": ckpt, "time": at(t).isoformat()})
        assert r.status_code == 200, r.text
    if finished:
        with app.state.sessions() as session:
            session.get(Job, job["id"]).phase = "SUCCEEDED"
            session.commit()
    return job["id"]


def test_goodput_of_a_restarted_job_is_the_hand_computed_figure(client, app, settings) -> None:
    job_id = inject_restarted_job(client, app, settings, finished=True)
    g = client.get(f"/v1/jobs/{job_id}/goodput", headers=ADMIN).json()
    # by hand (tests/controller/test_goodput.py): productive 260 s of 402 s
    assert g["goodput"] == pytest.approx(260 / 402) and g["wall_s"] == pytest.approx(402)
    assert g["lost_s"] == pytest.approx({"queueing": 20, "start_up": 40, "restarts": 30, "recomputation": 40,
                                         "checkpoint_stalls": 10, "other": 2})
    assert g["mfu"] == pytest.approx(0.41) and g["tokens_per_s"] == 5000.0 and g["step"] == 400
    assert g["eta_s"] is None  # finished
    points = client.get(f"/v1/jobs/{job_id}/metrics", headers=ADMIN).json()["points"]
    assert [p["mfu"] for p in points] == [0.41] * 7 and points[-1]["checkpoint_s"] == 6.0


def test_running_jobs_have_bounded_per_job_gauges(client, app, settings) -> None:
    job_id = inject_restarted_job(client, app, settings, finished=False)
    done = inject_restarted_job(client, app, settings, finished=True)
    g = client.get(f"/v1/jobs/{job_id}/goodput", headers=ADMIN).json()
    assert g["eta_s"] == pytest.approx((1000 - 400) * 90 / 150)  # 150 steps in the newest 90 s
    text = client.get("/metrics").text
    assert f'deepfleet_job_lost_seconds{{cause="restarts",job="{job_id}",project="research"}} 30.0' in text
    assert f'deepfleet_job_mfu_ratio{{job="{job_id}",project="research"}} 0.41' in text
    assert f'deepfleet_job_tokens_per_second{{job="{job_id}",project="research"}} 5000.0' in text
    assert f'deepfleet_job_goodput_ratio{{job="{job_id}",project="research"}}' in text
    assert done not in text  # finished jobs leave the label set
