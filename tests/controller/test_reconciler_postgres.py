"""The reconciler on PostgreSQL (row claims with SELECT ... FOR UPDATE SKIP LOCKED): several replicas in
threads over one database run each job exactly once, and a dead replica's claims move to a live one."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import select

from deepfleet.controller.db.models import Attempt, Event
from tests.controller.reconcile_helpers import (
    database,
    drive,
    events,
    insert_job,
    job,
    job_document,
    reconciler,
    run_replicas_until_succeeded,
    starts,
)


@pytest.fixture()
def sessions(db_url: str):
    factory = database(db_url)
    yield factory
    factory.kw["bind"].dispose()


def test_three_replicas_run_each_job_exactly_once(sessions, tmp_path: Path) -> None:
    ids = [insert_job(sessions, job_document(f"pg{i}", args=["--steps", "2"], nodes=1)) for i in range(9)]
    replicas = [reconciler(sessions, tmp_path, replica=f"r{i}") for i in range(3)]
    run_replicas_until_succeeded(replicas, sessions, ids, interval_s=0.02)
    assert [job(sessions, j).phase for j in ids] == ["SUCCEEDED"] * 9
    for i, j in enumerate(ids):
        assert starts(tmp_path, f"df-pg{i}-{j[:8]}-a0") == 1
        assert events(sessions, j).count("Submitted") == 1 and events(sessions, j).count("Admitted") == 1
    with sessions() as s:
        assert len(s.scalars(select(Attempt)).all()) == 9
        assert {e.actor for e in s.scalars(select(Event))} <= {"r0", "r1", "r2"}


def test_a_dead_replicas_jobs_move_to_a_live_one_after_the_lease(sessions, tmp_path: Path) -> None:
    job_id = insert_job(sessions, job_document("handover", args=["--steps", "30", "--step-s", "0.05"], nodes=1))
    now = datetime.now(timezone.utc)
    dead = reconciler(sessions, tmp_path, replica="dead", lease_seconds=5)
    drive(dead, sessions, job_id, {"RUNNING"}, now=lambda: now)
    live = reconciler(sessions, tmp_path, replica="live", lease_seconds=5)
    live.reconcile_once(now + timedelta(seconds=1))  # the claim is still held: hands off
    assert job(sessions, job_id).claimed_by == "dead"
    final = drive(live, sessions, job_id, {"SUCCEEDED", "FAILED"}, now=lambda: now + timedelta(seconds=6))
    assert final.phase == "SUCCEEDED" and starts(tmp_path, f"df-handover-{job_id[:8]}-a0") == 1
    for proc in dead.backend._children.values():  # the "dead" replica object is still the parent: reap
        proc.wait(timeout=5)
