"""A throwaway PostgreSQL cluster for the controller tests (initdb + pg_ctl, fsync off, random port).

Used by `tests/controller/conftest.py` (session fixture) and `benchmarks/controller_api.py`.
PostgreSQL refuses to run as root, so when the tests run as root the server runs as the `postgres`
user (`runuser`) and the temporary directory is handed to it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_server_user(argv: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", "postgres", "--", *argv]


@contextmanager
def postgres_cluster() -> Iterator[str]:
    """Start a private cluster; yield its admin URL (postgresql+psycopg://postgres@127.0.0.1:<port>/postgres)."""
    pg_bin = _pg_bin()
    if pg_bin is None:
        raise RuntimeError("PostgreSQL server binaries not found; install postgresql (apt-get install postgresql)")
    tmp = Path(tempfile.mkdtemp(prefix="deepfleet-pg-"))
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(tmp, user.pw_uid, user.pw_gid)
    data = tmp / "data"
    port = _free_port()
    subprocess.run(
        _as_server_user([str(pg_bin / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                         "-E", "UTF8", "--no-sync"]),
        check=True, capture_output=True, timeout=120,
    )
    options = (f"-p {port} -k {tmp} -c listen_addresses=127.0.0.1 -c fsync=off "
               "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
    subprocess.run(
        _as_server_user([str(pg_bin / "pg_ctl"), "-D", str(data), "-l", str(tmp / "log"), "-w", "-o", options,
                         "start"]),
        check=True, capture_output=True, timeout=120,
    )
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            _as_server_user([str(pg_bin / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
            capture_output=True, timeout=120,
        )
        shutil.rmtree(tmp, ignore_errors=True)
