"""Alembic environment: runs the controller's migrations against `Base.metadata`.

Run by Alembic itself (the `alembic` command, configured from `[tool.alembic]` in pyproject.toml,
or `deepfleet.controller.db.migrate.upgrade_head`), never imported by our code. The database comes
from, in order: a connection passed in `config.attributes["connection"]`, the `sqlalchemy.url`
option, then the controller settings (`DEEPFLEET_DATABASE_URL` / `DATABASE_URL`).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from deepfleet.controller.db.models import Base
from deepfleet.controller.db.session import make_engine

target_metadata = Base.metadata


def _url() -> str:
    url = context.config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from deepfleet.controller.settings import Settings

    return Settings.from_env().db_url


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
