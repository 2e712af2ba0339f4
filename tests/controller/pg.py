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


class PostgresCluster:
    """A private cluster (fsync off) on a Unix socket in its own folder; `stop()`/`start()` take it down and
    up at the same address, as an outage would; `close()` removes it."""

    def __init__(self) -> None:
        pg_bin = _pg_bin()
        if pg_bin is None:
            raise RuntimeError("PostgreSQL server binaries not found; install postgresql (apt-get install postgresql)")
        self.pg_bin = pg_bin
        self.tmp = Path(tempfile.mkdtemp(prefix="deepfleet-pg-"))
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.tmp, user.pw_uid, user.pw_gid)
        self.data = self.tmp / "data"
        subprocess.run(
            _as_server_user([str(pg_bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust",
                             "-E", "UTF8", "--no-sync"]),
            check=True, capture_output=True, timeout=120,
        )
        self.url = f"postgresql+psycopg://postgres@/postgres?host={self.tmp}"
        self.start()

    def start(self) -> None:
        options = (f"-k {self.tmp} -c listen_addresses='' -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        subprocess.run(
            _as_server_user([str(self.pg_bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.tmp / "log"), "-w",
                             "-o", options, "start"]),
            check=True, capture_output=True, timeout=120,
        )

    def stop(self, *, mode: str = "fast") -> None:
        """Stop the server (`fast`: sessions are cut, as in a failover; `immediate`: a crash)."""
        subprocess.run(_as_server_user([str(self.pg_bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"]),
                       check=True, capture_output=True, timeout=120)

    def close(self) -> None:
        subprocess.run(_as_server_user([str(self.pg_bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"]),
                       capture_output=True, timeout=120)
        shutil.rmtree(self.tmp, ignore_errors=True)


@contextmanager
def postgres_cluster() -> Iterator[str]:
    """Start a private cluster; yield its admin URL (postgresql+psycopg://postgres@/postgres?host=<socket folder>)."""
    cluster = PostgresCluster()
    try:
        yield cluster.url
    finally:
        cluster.close()
