"""Migrations against a real PostgreSQL: head on an empty database, no drift from the models,
downgrade-to-base / upgrade-to-head round trip; plus the embedded SQLite default."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, select
from sqlalchemy.exc import IntegrityError

from deepfleet.controller.db.migrate import downgrade_base, upgrade_head
from deepfleet.controller.db.models import Base, Job, Project, Queue
from deepfleet.controller.db.session import make_engine, make_session_factory
from deepfleet.controller.settings import Settings

TABLES = {"projects", "api_tokens", "queues", "jobs", "job_labels", "attempts", "events", "heartbeats", "leases"}


def _drift(url: str) -> list:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_head_on_empty_postgres_has_no_drift(empty_db_url: str) -> None:
    upgrade_head(empty_db_url)
    assert TABLES <= _tables(empty_db_url)
    assert _drift(empty_db_url) == []
    upgrade_head(empty_db_url)  # idempotent


def test_downgrade_base_and_upgrade_again(empty_db_url: str) -> None:
    upgrade_head(empty_db_url)
    downgrade_base(empty_db_url)
    assert _tables(empty_db_url) <= {"alembic_version"}
    upgrade_head(empty_db_url)
    assert _drift(empty_db_url) == []
    engine = make_engine(empty_db_url)
    with make_session_factory(engine)() as session:
        assert session.scalars(select(Queue.name)).all() == ["default"]
    engine.dispose()


def _job(job_id: str, **kw) -> Job:
    return Job(id=job_id, name="gpt", project="p", queue="default", backend="local", priority="normal",
               spec={"kind": "TrainingJob"}, spec_version="deepfleet/v1", world_size=2, phase="PENDING", **kw)


def test_models_round_trip_utc_and_foreign_keys(db_url: str) -> None:
    engine = make_engine(db_url)
    factory = make_session_factory(engine)
    later = datetime(2030, 1, 1, 12, tzinfo=timezone(timedelta(hours=2)))
    with factory() as session:
        session.add(Project(name="p"))
        session.flush()
        session.add(_job("a" * 32, not_before=later))
        session.commit()
    with factory() as session:
        job = session.get(Job, "a" * 32)
        assert job.not_before == later and job.not_before.tzinfo == timezone.utc
        assert job.created_at.tzinfo == timezone.utc
        assert job.desired_state == "run" and job.restart_counts == {} and job.current_attempt == 0
    engine.dispose()


def test_embedded_sqlite_default(tmp_path: Path) -> None:
    settings = Settings.from_env({"HOME": str(tmp_path)})
    assert settings.db_url == f"sqlite:///{tmp_path}/.local/share/deepfleet/deepfleet.db"
    upgrade_head(settings.db_url)
    engine = make_engine(settings.db_url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    factory = make_session_factory(engine)
    with factory() as session:
        session.add(_job("b" * 32))  # project "p" does not exist: the foreign key must refuse it
        with pytest.raises(IntegrityError, match="FOREIGN KEY"):
            session.commit()
    engine.dispose()


def test_db_upgrade_command(empty_db_url: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "deepfleet.controller.cli", "db", "upgrade", "--database-url",
                           empty_db_url], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert TABLES <= _tables(empty_db_url)
    assert _drift(empty_db_url) == []
