"""Engine and session factories built from settings (no module-level engine or session).

Called by `create_app`, the reconciler loop, the migrations helper and tests. For the embedded
SQLite default it creates the database's folder and the file (mode 0600) and sets the pragmas a multi-threaded server needs:
WAL (readers do not block the writer), foreign keys on (SQLite leaves them off), and a busy
timeout instead of immediate "database is locked" errors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 5000


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")  # safe with WAL; FULL fsyncs every commit
    finally:
        cursor.close()


def make_engine(url: str, *, echo: bool = False, pool_size: int = 10, max_overflow: int = 20) -> Engine:
    """A SQLAlchemy engine for `url`; SQLite gets its folder created and the pragmas above. The API sizes
    the pool from its request limit (`Settings.max_inflight_requests`) so no request waits on the pool."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            path = Path(parsed.database).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            # Owner-only from the first byte (SQLite gives its -wal/-shm files the database's mode).
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            os.chmod(path, 0o600)
        engine = create_engine(url, echo=echo, connect_args={"check_same_thread": False})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # pre_ping: a controller outlives database restarts and failovers.
    return create_engine(url, echo=echo, pool_pre_ping=True, pool_size=pool_size, max_overflow=max_overflow,
                         pool_timeout=10)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded attributes after commit (responses are built after the commit)."""
    return sessionmaker(engine, expire_on_commit=False)
