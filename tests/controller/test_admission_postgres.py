"""Admission passes on PostgreSQL are bounded in rows locked: a pass over many PENDING jobs locks at most
`admit_batch` rows at a time (seen through `pgrowlocks` while the pass holds them), a concurrent cancel of
any other pending job goes through at once, and a row held by another transaction is skipped, not
waited on, and admitted on a later pass. Priority order is kept across batches and passes."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import create_engine, event, insert, select, text

from deepfleet.controller.db.jobs import request_cancel
from deepfleet.controller.db.models import Job
from deepfleet.controller.scheduler import UNLIMITED
from tests.controller.jobspecs import job_document
from tests.controller.reconcile_helpers import database, reconciler

T0 = datetime(2026, 6, 1, tzinfo=timezone.utc)


@pytest.fixture()
def sessions(db_url: str):
    factory = database(db_url)
    yield factory
    factory.kw["bind"].dispose()


def _pending(sessions, n: int, *, priority=lambda i: "normal") -> list[str]:
    """`n` PENDING one-process jobs, created one millisecond apart, in one statement."""
    ids = [uuid.uuid4().hex for _ in range(n)]
    rows = [dict(id=job_id, name=f"j{i}", project="test", queue="default", backend="local",
                 priority=priority(i), spec=job_document(f"j{i}", nodes=1), spec_version="deepfleet/v1",
                 world_size=1, gpus=0, phase="PENDING", created_at=T0 + timedelta(milliseconds=i))
            for i, job_id in enumerate(ids)]
    with sessions() as s, s.begin():
        s.execute(insert(Job), rows)
    return ids


def _phases(sessions, ids: list[str]) -> list[str]:
    with sessions() as s:
        by_id = dict(s.execute(select(Job.id, Job.phase).where(Job.id.in_(ids))).all())
    return [by_id[i] for i in ids]


def _bounded(rec, *, batch: int, budget: int):
    from dataclasses import replace

    rec.config = replace(rec.config, capacity=UNLIMITED, admit_batch=batch, admit_budget=budget)
    return rec


def test_a_pass_locks_at_most_a_batch_and_a_concurrent_cancel_is_not_blocked(sessions, db_url, tmp_path: Path):
    ids = _pending(sessions, 400)
    rec = _bounded(reconciler(sessions, tmp_path), batch=25, budget=100)
    observer = create_engine(db_url, isolation_level="AUTOCOMMIT")
    with observer.connect() as c:
        c.execute(text("CREATE EXTENSION IF NOT EXISTS pgrowlocks"))
    seen: list[int] = []
    cancelled: list[str] = []

    def while_locked(conn, cursor, statement, *args) -> None:
        if "FOR UPDATE SKIP LOCKED" not in statement or "FROM jobs" not in statement:
            return
        with observer.connect() as c:
            seen.append(c.execute(text("SELECT count(*) FROM pgrowlocks('jobs')")).scalar_one())
        victim = ids[-1 - len(cancelled)]  # a pending job outside this pass's budget
        with sessions() as s:  # the API's cancel path, which would wait behind a row lock
            s.execute(text("SET LOCAL lock_timeout = '2s'"))
            request_cancel(s, s.get(Job, victim), actor="test")
            s.commit()
        cancelled.append(victim)

    engine = sessions.kw["bind"]
    event.listen(engine, "after_cursor_execute", while_locked)
    try:
        rec._hold_lease("scheduler-local", T0)
        rec._admit(T0 + timedelta(seconds=1))
    finally:
        event.remove(engine, "after_cursor_execute", while_locked)
        observer.dispose()
    assert len(seen) == 4 and max(seen) <= 25  # 100 decisions, four transactions of 25 rows
    assert len(cancelled) == 4  # each cancel committed while a batch held its rows
    phases = _phases(sessions, ids)
    assert phases[:100] == ["ADMITTED"] * 100  # FIFO: the first 100 in rank order
    assert phases[100:-4] == ["PENDING"] * 296
    with sessions() as s:
        assert {s.get(Job, v).desired_state for v in cancelled} == {"cancel_requested"}


def test_a_row_held_elsewhere_is_skipped_then_admitted_next_pass(sessions, tmp_path: Path) -> None:
    ids = _pending(sessions, 30, priority=lambda i: "high" if i < 10 else "low")
    rec = _bounded(reconciler(sessions, tmp_path), batch=8, budget=20)
    rec._hold_lease("scheduler-local", T0)
    with sessions() as holder:  # another transaction holds the row of the first high-priority job
        holder.execute(select(Job).where(Job.id == ids[0]).with_for_update())
        rec._admit(T0 + timedelta(seconds=1))
        holder.rollback()
    phases = _phases(sessions, ids)
    assert phases[0] == "PENDING" and phases[1:20] == ["ADMITTED"] * 19 and phases[20:] == ["PENDING"] * 10
    rec._admit(T0 + timedelta(seconds=2))
    assert _phases(sessions, ids)[0] == "ADMITTED"  # high priority: first in line on the next pass
    assert _phases(sessions, ids).count("ADMITTED") == 30  # the remaining 10 fit in the next budget


def test_a_pass_reads_a_window_of_the_queue_in_rank_order(sessions, tmp_path: Path) -> None:
    """Thousands pending, a window of 50: the pass fetches at most one window per base priority and
    admits exactly the head of the whole ranking (aged low-priority jobs included)."""
    n = 3000
    ids = _pending(sessions, n, priority=lambda i: ("low", "normal", "high")[i % 3])
    rec = _bounded(reconciler(sessions, tmp_path), batch=20, budget=40)
    from dataclasses import replace

    rec.config = replace(rec.config, admit_window=50, aging_s=1.0)
    fetched: list[int] = []
    engine = sessions.kw["bind"]

    def count(conn, cursor, statement, *args) -> None:
        if statement.lstrip().startswith("SELECT") and "ORDER BY jobs.created_at" in statement:
            fetched.append(cursor.rowcount)

    event.listen(engine, "after_cursor_execute", count)
    try:
        rec._hold_lease("scheduler-local", T0)
        rec._admit(T0 + timedelta(seconds=1.5))  # 1.5 s of aging: every job ranks one level up
    finally:
        event.remove(engine, "after_cursor_execute", count)
    assert fetched == [50, 50, 50]
    # aged one level: normal ranks with high (FIFO between them), low ranks as normal, after them
    expected = [i for k, i in enumerate(ids) if k % 3 != 0][:40]
    admitted = {i for i, phase in zip(ids, _phases(sessions, ids), strict=True) if phase == "ADMITTED"}
    assert admitted == set(expected)
