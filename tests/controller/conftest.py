"""Controller test fixtures: a real throwaway PostgreSQL 15 cluster for the session, a fresh database
per test (cloned from a migrated template, ~0.1 s), and settings/app/client built on it."""

from __future__ import annotations

import uuid
import warnings
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from deepfleet.controller.db.migrate import upgrade_head
from tests.controller.pg import postgres_cluster

# Starlette's TestClient prefers the httpx2 package and warns (deprecation) when it falls back to httpx,
# which the controller extra installs. Import it once here with only that warning silenced.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient` is deprecated")
    from fastapi.testclient import TestClient


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """Admin URL of a private PostgreSQL cluster started for this test session."""
    with postgres_cluster() as url:
        yield url


def _admin(url: str, *statements: str) -> None:
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            for statement in statements:
                conn.execute(text(statement))
    finally:
        engine.dispose()


def _db_url(pg_url: str, name: str) -> str:
    return make_url(pg_url).set(database=name).render_as_string(hide_password=False)


@pytest.fixture()
def empty_db_url(pg_url: str) -> Iterator[str]:
    """URL of a new, empty database (dropped after the test)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    _admin(pg_url, f'CREATE DATABASE "{name}"')
    yield _db_url(pg_url, name)
    _admin(pg_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def migrated_template(pg_url: str) -> str:
    """Name of a database migrated to head once, cloned by `db_url`."""
    name = "deepfleet_template"
    _admin(pg_url, f'CREATE DATABASE "{name}"')
    upgrade_head(_db_url(pg_url, name))
    return name


@pytest.fixture()
def db_url(pg_url: str, migrated_template: str) -> Iterator[str]:
    """URL of a fresh database at the newest schema (a clone of the migrated template)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    _admin(pg_url, f'CREATE DATABASE "{name}" TEMPLATE "{migrated_template}"')
    yield _db_url(pg_url, name)
    _admin(pg_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


ADMIN_TOKEN = "dft_0123456789ab_" + "s" * 32


@pytest.fixture()
def settings(db_url: str, tmp_path):
    """Settings on the per-test Postgres database (already migrated), logs under tmp_path."""
    from deepfleet.controller.settings import Settings

    return Settings(data_dir=tmp_path, database_url=db_url, migrate_on_start=False, secret="test-secret",
                    admin_token=ADMIN_TOKEN, admin_project="research", max_request_bytes=64 * 1024)


@pytest.fixture()
def app(settings):
    from deepfleet.controller.app import create_app

    app = create_app(settings, log_poll_s=0.02)
    yield app
    app.state.engine.dispose()  # also when no client ran the lifespan (which disposes it too)


@pytest.fixture()
def client(app):
    """A TestClient with the lifespan run (bootstrap admin token of project "research" ensured)."""
    with TestClient(app) as c:
        yield c
