"""End to end with the real `deepfleet-worker` on PostgreSQL: the example GPT job (2 nodes, ZeRO stage 2,
managed loop) submitted over HTTP trains to SUCCEEDED with a checkpoint; SIGKILL of one node's worker
process mid-run sends the job through RESTARTING and the next attempt resumes from the checkpoint;
cancel leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from deepfleet.controller.backends.local import _alive, _marked
from deepfleet.controller.cli_jobs import load_job_document
from tests.controller.e2e_helpers import Controller, wait_phase
from tests.controller.jobspecs import checkpoint_dir

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def gpt_job(ckpt: str, *, steps: int, name: str) -> str:
    doc = json.loads(load_job_document(ROOT / "examples" / "gpt" / "job.yaml"))
    doc["metadata"].update(name=name, project="test")
    doc["spec"]["entrypoint"]["args"] = {"num_samples": 4096}
    doc["spec"]["maxSteps"] = steps
    doc["spec"]["checkpoint"] = {"dir": ckpt, "everySteps": 10, "keepLast": 2}
    doc["spec"]["restartPolicy"] = {"maxRestarts": 2, "backoffSeconds": 1}
    return json.dumps(doc)


def worker_pid(run: str, node: int) -> int:
    """The node's deepfleet-worker process: the child of the node's exit-recording wrapper."""
    state = json.loads((Path(os.environ["DF_E2E_LOGS"]) / run / "state.json").read_text())
    wrapper = state["pids"][node]
    for pid in _marked(run):
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        if int(stat[1]) == wrapper:
            return pid
    raise AssertionError(f"no worker process under wrapper {wrapper}")


def test_gpt_job_trains_survives_a_killed_worker_and_cancels(db_url: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data"
    monkeypatch.setenv("DF_E2E_LOGS", str(data / "logs"))
    c = Controller(db_url, data, workdir=ROOT, heartbeat_interval=1.0)
    try:
        job = c.client.submit(gpt_job("ck", steps=50, name="gpt-kill"), content_type="application/json")
        ck = checkpoint_dir(data, job["id"], "ck")
        wait_phase(c.client, job["id"], {"RUNNING"}, timeout=120)
        run0 = f"df-gpt-kill-{job['id'][:8]}-a0"
        deadline = time.monotonic() + 180
        while not (ck / "latest").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (ck / "latest").exists(), c.client.logs(job["id"], tail=30)
        os.kill(worker_pid(run0, 1), signal.SIGKILL)
        restarting = wait_phase(c.client, job["id"], {"RESTARTING", "FAILED", "SUCCEEDED"}, timeout=60)
        assert restarting["phase"] == "RESTARTING", c.client.events(job["id"])
        done = wait_phase(c.client, job["id"], {"SUCCEEDED", "FAILED"}, timeout=300)
        assert done["phase"] == "SUCCEEDED", [e["message"] for e in c.client.events(job["id"])]
        assert done["attempt"] == 1 and done["restart_counts"] == {"node_lost": 1}
        assert (ck / "global_step50" / "COMPLETE").exists()
        resumed = c.client.logs(job["id"], node=0, attempt=1)
        assert "from checkpoint global_step" in resumed and "starting at step 0/" not in resumed
        assert _marked(run0) == []
        assert any(p["loss"] is not None for p in c.client.metrics(job["id"]))

        long = c.client.submit(gpt_job("ck2", steps=100000, name="gpt-cancel"),
                               content_type="application/json")
        wait_phase(c.client, long["id"], {"RUNNING"}, timeout=120)
        run = f"df-gpt-cancel-{long['id'][:8]}-a0"
        deadline = time.monotonic() + 120
        while not c.client.get(long["id"])["last_heartbeat"] and time.monotonic() < deadline:
            time.sleep(0.5)
        pids = _marked(run)
        assert len(pids) >= 6  # per node: wrapper, deepfleet-worker, training process
        c.client.cancel(long["id"])
        assert wait_phase(c.client, long["id"], {"CANCELLED"}, timeout=60)["phase"] == "CANCELLED"
        assert [p for p in pids if _alive(p)] == []
    finally:
        c.stop()
