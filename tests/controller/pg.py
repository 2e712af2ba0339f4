"""A throwaway PostgreSQL cluster for the controller tests (initdb + pg_ctl, fsync off).

The server listens only on a Unix socket in the cluster's own private folder, so no TCP port is
chosen and bound later (two clusters, e.g. one per test process, can never race for a port).

Used by `tests/controller/conftest.py` (session fixture) and `benchmarks/controller_api.py`.
PostgreSQL refuses to run as root, so when the tests run as root the server runs as the `postgres`
user (`runuser`) and the temporary directory is handed to it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _pg_bin() -> Path | None:
    """The newest installed server's bin folder (Debian layout), else wherever `initdb` is on PATH."""
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    if versions:
        return versions[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _as_server_user(argv: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", "postgres", "--", *argv]


@contextmanager
def postgres_cluster() -> Iterator[str]:
    """Start a private cluster; yield its admin URL (postgresql+psycopg://postgres@/postgres?host=<socket folder>)."""
    pg_bin = _pg_bin()
    if pg_bin is None:
        raise RuntimeError("PostgreSQL server binaries not found; install postgresql (apt-get install postgresql)")
    tmp = Path(tempfile.mkdtemp(prefix="deepfleet-pg-"))
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(tmp, user.pw_uid, user.pw_gid)
    data = tmp / "data"
    subprocess.run(
        _as_server_user([str(pg_bin / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                         "-E", "UTF8", "--no-sync"]),
        check=True, capture_output=True, timeout=120,
    )
    options = (f"-k {tmp} -c listen_addresses='' -c fsync=off "
               "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
    subprocess.run(
        _as_server_user([str(pg_bin / "pg_ctl"), "-D", str(data), "-l", str(tmp / "log"), "-w", "-o", options,
                         "start"]),
        check=True, capture_output=True, timeout=120,
    )
    try:
        yield f"postgresql+psycopg://postgres@/postgres?host={tmp}"
    finally:
        subprocess.run(
            _as_server_user([str(pg_bin / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
            capture_output=True, timeout=120,
        )
        shutil.rmtree(tmp, ignore_errors=True)
