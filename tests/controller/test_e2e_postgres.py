"""End to end on PostgreSQL: a real controller process (API + reconciler + local backend) and worker
processes (the fake worker: same spec/env/heartbeat/checkpoint/exit contract, no torch), driven over HTTP.

Submit -> admitted -> 2 worker processes -> SUCCEEDED with a checkpoint; SIGKILL of one worker
process -> RESTARTING -> finished from the checkpoint; cancel -> processes gone; the controller
SIGKILLed mid-reconcile and restarted -> no job lost, none started twice; two controllers on one
database -> each job runs exactly once.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import yaml

from deepfleet.controller.backends.local import _alive, _marked
from tests.controller.e2e_helpers import Controller, node_pids, starts, wait_phase
from tests.controller.jobspecs import FAKE_WORKER, checkpoint_dir, job_document

pytestmark = pytest.mark.e2e
START = "fake worker node"


def submit(controller: Controller, name: str, args: list[str], **kw) -> str:
    doc = job_document(name, args=args, **kw)
    doc["metadata"]["project"] = "test"
    return controller.client.submit(yaml.safe_dump(doc))["id"]


def test_submit_train_kill_a_worker_restart_from_checkpoint_and_cancel(db_url: str, tmp_path: Path) -> None:
    c = Controller(db_url, tmp_path / "data", worker_command=FAKE_WORKER)
    logs = tmp_path / "data" / "logs"
    try:
        # 1. submit over HTTP -> admitted -> two processes train -> SUCCEEDED, checkpoint written
        ok = submit(c, "ok", ["--steps", "6", "--step-s", "0.05"], ckpt="ck-ok")
        job = wait_phase(c.client, ok, {"SUCCEEDED", "FAILED"})
        assert job["phase"] == "SUCCEEDED", c.client.events(ok)
        types = [e["type"] for e in c.client.events(ok)]
        assert types[:3] == ["Submitted", "Admitted", "Submitted"] and types[-1] == "Succeeded"
        assert (checkpoint_dir(tmp_path / "data", ok, "ck-ok") / "global_step6" / "COMPLETE").exists()
        assert job["last_heartbeat"]["step"] == 6 and len(c.client.metrics(ok)) == 6
        assert "done" in c.client.logs(ok, node=1, tail=1)

        # 2. SIGKILL one worker process mid-run -> RESTARTING -> a new attempt resumes from the checkpoint
        kill = submit(c, "kill", ["--steps", "40", "--step-s", "0.1"], ckpt="ck-kill")
        wait_phase(c.client, kill, {"RUNNING"})
        run0 = f"df-kill-{kill[:8]}-a0"
        deadline = time.monotonic() + 30
        while not (checkpoint_dir(tmp_path / "data", kill, "ck-kill") / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        victims = node_pids(run0, 1, "fake_worker.py")
        assert len(victims) == 1
        os.kill(victims[0], signal.SIGKILL)
        job = wait_phase(c.client, kill, {"RESTARTING", "FAILED"})
        assert job["phase"] == "RESTARTING" and job["restart_counts"] == {"node_lost": 1}
        job = wait_phase(c.client, kill, {"SUCCEEDED", "FAILED"})
        assert job["phase"] == "SUCCEEDED" and job["attempt"] == 1
        resumed = c.client.logs(kill, node=0, attempt=1)
        assert "resuming from global_step" in resumed and "step 1 loss" not in resumed
        assert _marked(run0) == []

        # 3. cancel -> every process gone -> CANCELLED
        long = submit(c, "long", ["--steps", "1000", "--step-s", "0.1", "--child"])
        wait_phase(c.client, long, {"RUNNING"})
        run = f"df-long-{long[:8]}-a0"
        deadline = time.monotonic() + 10
        while len(_marked(run)) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = _marked(run)
        c.client.cancel(long)
        assert wait_phase(c.client, long, {"CANCELLED"})["phase"] == "CANCELLED"
        assert [p for p in pids if _alive(p)] == []
    finally:
        c.stop()
    assert starts(logs, f"df-ok-{ok[:8]}-a0", 0, START) == 1


@pytest.mark.slow
def test_controller_killed_mid_reconcile_loses_nothing_and_starts_nothing_twice(db_url: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = Controller(db_url, data, worker_command=FAKE_WORKER, replica="first")
    ids = [submit(first, f"crash{i}", ["--steps", "8", "--step-s", "0.1"], nodes=1 + i % 2) for i in range(8)]
    time.sleep(0.7)  # some jobs admitted, some submitted, some running: kill the controller in the middle
    first.kill()
    first.client.close()
    second = Controller(db_url, data, worker_command=FAKE_WORKER, replica="second")
    try:
        for job_id in ids:
            assert wait_phase(second.client, job_id, {"SUCCEEDED", "FAILED"}, timeout=90)["phase"] == "SUCCEEDED"
        for i, job_id in enumerate(ids):
            job = second.client.get(job_id)
            assert [a["number"] for a in job["attempts"]] == [0]
            for node in range(1 + i % 2):
                assert starts(data / "logs", f"df-crash{i}-{job_id[:8]}-a0", node, START) == 1
    finally:
        second.stop()


@pytest.mark.slow
def test_two_controllers_on_one_database_run_each_job_exactly_once(db_url: str, tmp_path: Path) -> None:
    data = tmp_path / "data"
    a = Controller(db_url, data, worker_command=FAKE_WORKER, replica="a")
    b = Controller(db_url, data, worker_command=FAKE_WORKER, replica="b")
    try:
        ids = [submit(a if i % 2 else b, f"twin{i}", ["--steps", "3"], nodes=1) for i in range(10)]
        for job_id in ids:
            assert wait_phase(a.client, job_id, {"SUCCEEDED", "FAILED"}, timeout=90)["phase"] == "SUCCEEDED"
        actors = set()
        for i, job_id in enumerate(ids):
            assert starts(data / "logs", f"df-twin{i}-{job_id[:8]}-a0", 0, START) == 1
            events = a.client.events(job_id)
            assert [e["type"] for e in events].count("Running") <= 1
            assert len(a.client.get(job_id)["attempts"]) == 1
            actors |= {e["actor"] for e in events if e["type"] == "Submitted" and e["attempt"] == 0}
        assert actors <= {"a", "b"} | {e for e in actors if e.startswith("token:")}
    finally:
        a.stop()
        b.stop()
