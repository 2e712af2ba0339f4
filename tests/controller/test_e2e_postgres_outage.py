"""A real PostgreSQL outage under traffic: the throwaway cluster is stopped while clients submit and list
jobs against a real controller process, then started again. During the outage every API answer is a
503 JSON body with Retry-After (never a 500 or a traceback) and /healthz still answers; the controller
logs the outage once (and its end once), not once per request or per reconcile pass; after the start it
serves again and every job it acknowledged runs to SUCCEEDED (nothing lost)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from deepfleet.controller.db.migrate import upgrade_head
from tests.controller.conftest import ADMIN_TOKEN
from tests.controller.e2e_helpers import Controller, wait_phase
from tests.controller.jobspecs import FAKE_WORKER, job_document
from tests.controller.pg import PostgresCluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _job(i: int) -> str:
    doc = job_document(f"out{i}", args=["--steps", "2"], nodes=1, max_restarts=0)
    doc["metadata"]["project"] = "test"
    return yaml.safe_dump(doc)


class Traffic(threading.Thread):
    """Submits and lists jobs back to back; records every answer (sent at, call, status, headers, body,
    answered at), a transport error as status -1."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.http = httpx.Client(base_url=url, headers=AUTH, timeout=30)
        self.answers: list[tuple[float, str, int, dict, str, float]] = []
        self.acknowledged: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            for call, send in (("submit", lambda i=i: self.http.post("/v1/jobs", content=_job(i), headers={
                                   "Content-Type": "application/yaml"})),
                               ("list", lambda: self.http.get("/v1/jobs", params={"limit": 5})),
                               ("healthz", lambda: self.http.get("/healthz"))):
                sent = time.monotonic()
                try:
                    r = send()
                except httpx.TransportError as exc:  # a cut connection is recorded (and fails the test)
                    self.answers.append((sent, call, -1, {}, repr(exc), time.monotonic()))
                    continue
                self.answers.append((sent, call, r.status_code, dict(r.headers), r.text, time.monotonic()))
                if call == "submit" and r.status_code == 201:
                    self.acknowledged.append(r.json()["id"])
            time.sleep(0.05)


def test_a_stopped_database_gives_503_json_one_log_line_and_loses_nothing(tmp_path: Path) -> None:
    cluster = PostgresCluster()
    traffic = None
    try:
        upgrade_head(cluster.url)
        c = Controller(cluster.url, tmp_path / "data", worker_command=FAKE_WORKER, replica="outage")
        try:
            traffic = Traffic(c.url)
            traffic.start()
            while len(traffic.acknowledged) < 5:
                time.sleep(0.05)
            cluster.stop()
            down_at = time.monotonic()
            time.sleep(4)
            start_at = time.monotonic()  # the server accepts again somewhat before pg_ctl's wait returns
            cluster.start()
            up_at = time.monotonic()
            deadline = up_at + 30
            while time.monotonic() < deadline and not any(
                    t > up_at and call == "submit" and status == 201 for t, call, status, *_ in traffic.answers):
                time.sleep(0.1)
            time.sleep(1)
            traffic.stop.set()
            traffic.join(timeout=60)

            during = [a for a in traffic.answers if down_at < a[0] and a[5] < start_at]  # sent and answered while down
            api = [a for a in during if a[1] != "healthz"]
            cut = [a for a in traffic.answers if a[2] == -1]
            assert not cut, f"the server cut a connection: {cut}"
            assert len(api) >= 4, traffic.answers[-10:]
            for _, call, status, headers, body, _ in api:
                assert status == 503, (call, status, body)
                assert headers["content-type"] == "application/json" and headers["retry-after"] == "5"
                assert body.startswith('{"detail":"database unavailable"') and "Traceback" not in body
            assert {status for _, call, status, *_ in during if call == "healthz"} == {200}
            assert not [a for a in traffic.answers if a[2] >= 500 and a[2] != 503], "a 5xx other than 503"
            recovered = [a for a in traffic.answers if a[0] > up_at and a[1] == "submit" and a[2] == 201]
            assert recovered, "no submit succeeded after the database came back"

            for job_id in traffic.acknowledged:  # every acknowledged submit is there and runs
                assert wait_phase(c.client, job_id, {"SUCCEEDED", "FAILED"}, timeout=90)["phase"] == "SUCCEEDED"
        finally:
            if traffic is not None:
                traffic.stop.set()
                traffic.join(timeout=60)
                traffic.http.close()
            c.stop()
        log = c.log.read_text()
        assert log.count("database unavailable") == 1, log[-4000:]
        assert log.count("database reachable again") == 1, log[-4000:]
        assert "Traceback" not in log, log[-4000:]
    finally:
        cluster.close()
