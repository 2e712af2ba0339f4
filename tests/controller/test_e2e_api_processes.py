"""`deepfleet server --api-processes N` on PostgreSQL: N processes answer the API on one socket, the
reconcilers run once, in the first; an extra process that dies is started again, and none outlives the
server (a clean stop or a SIGKILL of the first process)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.controller.conftest import ADMIN_TOKEN
from tests.controller.e2e_helpers import Controller, wait_phase
from tests.controller.jobspecs import FAKE_WORKER
from tests.controller.test_e2e_postgres import submit

pytestmark = pytest.mark.e2e
HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _extra(controller: Controller) -> list[psutil.Process]:
    """The server's live extra API processes (a killed one not yet reaped is a zombie: not counted)."""
    out = []
    for p in psutil.Process(controller.proc.pid).children():
        try:
            if "--api-only" in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def _wait(predicate, what: str, timeout: float = 60.0):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _answers(url: str) -> bool:
    try:  # a fresh connection each time, so any process may accept it
        with httpx.Client(base_url=url, headers=HEADERS, timeout=2) as c:
            return c.get("/v1/jobs").status_code == 200
    except httpx.HTTPError:
        return False


def test_extra_api_processes_answer_on_the_same_socket_and_the_jobs_still_run(db_url: str, tmp_path: Path) -> None:
    c = Controller(db_url, tmp_path / "data", worker_command=FAKE_WORKER,
                   extra_env={"DEEPFLEET_API_PROCESSES": "3"})
    try:
        extra = _wait(lambda: len(_extra(c)) == 2 and _extra(c), "two extra API processes")
        _wait(lambda: _answers(c.url), "answers")
        # With the first process stopped, the extra ones alone answer (and accept) on the socket.
        os.kill(c.proc.pid, signal.SIGSTOP)
        try:
            assert _wait(lambda: _answers(c.url), "an answer from an extra process", timeout=30)
        finally:
            os.kill(c.proc.pid, signal.SIGCONT)
        # The reconciler runs (in the first process only): a job runs to the end.
        job = submit(c, "multi", ["--steps", "3"])
        assert wait_phase(c.client, job, {"SUCCEEDED", "FAILED"}, timeout=90)["phase"] == "SUCCEEDED"
        # An extra process that dies is started again.
        victim = extra[0]
        victim.kill()
        _wait(lambda: len(_extra(c)) == 2 and victim.pid not in {p.pid for p in _extra(c)}, "a replacement")
    finally:
        try:
            survivors = _extra(c)
        finally:
            c.stop()
    gone, alive = psutil.wait_procs(survivors, timeout=30)
    assert alive == []


def test_extra_api_processes_exit_when_the_server_is_killed(db_url: str, tmp_path: Path) -> None:
    c = Controller(db_url, tmp_path / "data", worker_command=FAKE_WORKER,
                   extra_env={"DEEPFLEET_API_PROCESSES": "2"})
    extra = _wait(lambda: len(_extra(c)) == 1 and _extra(c), "one extra API process")
    c.kill()
    c.client.close()
    gone, alive = psutil.wait_procs(extra, timeout=30)
    assert alive == []
