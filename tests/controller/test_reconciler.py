"""The reconciler on SQLite with the local backend and the fake worker: the lifecycle end to end,
the failure ladder, cancel, admission, crash safety and two replicas on one database."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

from sqlalchemy import select

from deepfleet.controller.backends.local import _alive, _marked
from deepfleet.controller.compile import compile_submission
from deepfleet.controller.db.models import Attempt, Job
from deepfleet.controller.spec import JobSpec
from tests.controller.reconcile_helpers import (
    database,
    drive,
    events,
    insert_job,
    job,
    job_document,
    reconciler,
    run_replicas_until_succeeded,
    starts,
)


def sqlite(tmp_path: Path):
    return database(f"sqlite:///{tmp_path / 'db.sqlite'}")


def test_submitted_job_is_admitted_runs_and_succeeds(tmp_path: Path) -> None:
    sessions = sqlite(tmp_path)
    rec = reconciler(sessions, tmp_path)
    job_id = insert_job(sessions, job_document("ok", args=["--steps", "3"]))
    final = drive(rec, sessions, job_id, {"SUCCEEDED", "FAILED"})
    assert final.phase == "SUCCEEDED" and final.finished_at is not None and final.claimed_by is None
    assert events(sessions, job_id) == ["Admitted", "Submitted", "Succeeded"] or events(sessions, job_id) == [
        "Admitted", "Submitted", "Running", "Succeeded"]
    run = f"df-ok-{job_id[:8]}-a0"
    assert starts(tmp_path, run, 0) == starts(tmp_path, run, 1) == 1


def test_killed_node_restarts_with_backoff_and_resumes_from_checkpoint(tmp_path: Path) -> None:
    sessions = sqlite(tmp_path)
    rec = reconciler(sessions, tmp_path)
    doc = job_document("retry", args=["--steps", "6", "--fail-node", "1", "--fail-code", "137", "--fail-at-step", "4",
                                      "--step-s", "0.1"], ckpt="ckpt", backoff=30)
    job_id = insert_job(sessions, doc)
    clock = [datetime.now(timezone.utc)]
    restarting = drive(rec, sessions, job_id, {"RESTARTING", "FAILED", "SUCCEEDED"}, now=lambda: clock[0])
    assert restarting.phase == "RESTARTING" and restarting.current_attempt == 1
    assert restarting.restart_counts == {"node_lost": 1}
    # The backoff holds the next attempt back until the injected clock passes it.
    rec.reconcile_once(clock[0] + timedelta(seconds=29))
    assert starts(tmp_path, f"df-retry-{job_id[:8]}-a1") == 0
    clock[0] += timedelta(seconds=31)
    final = drive(rec, sessions, job_id, {"SUCCEEDED", "FAILED"}, now=lambda: clock[0])
    assert final.phase == "SUCCEEDED", events(sessions, job_id)
    assert "Restarting" in events(sessions, job_id)
    resumed = (tmp_path / "logs" / f"df-retry-{job_id[:8]}-a1" / "node-0.log").read_text()
    assert "resuming from global_step" in resumed and "step 1 loss" not in resumed
    # nothing of attempt 0 is left running
    assert _marked(f"df-retry-{job_id[:8]}-a0") == []


def test_oom_fails_without_retry_and_says_what_to_change(tmp_path: Path) -> None:
    sessions = sqlite(tmp_path)
    rec = reconciler(sessions, tmp_path)
    job_id = insert_job(sessions, job_document("oom", args=["--steps", "1", "--exit", "77"]))
    final = drive(rec, sessions, job_id, {"FAILED", "SUCCEEDED"})
    assert final.phase == "FAILED" and final.current_attempt == 0
    assert "train_micro_batch_size_per_gpu" in final.message
    assert events(sessions, job_id)[-1] == "OutOfMemory"


def test_restart_budget_is_enforced(tmp_path: Path) -> None:
    sessions = sqlite(tmp_path)
    rec = reconciler(sessions, tmp_path)
    job_id = insert_job(sessions, job_document("flaky", args=["--steps", "1", "--exit", "76"], max_restarts=1))
    final = drive(rec, sessions, job_id, {"FAILED", "SUCCEEDED"})
    assert final.phase == "FAILED" and final.current_attempt == 1
    assert events(sessions, job_id).count("Restarting") == 1 and events(sessions, job_id)[-1] == "RestartBudgetExhausted"


def test_cancel_stops_every_process(tmp_path: Path) -> None:
    sessions = sqlite(tmp_path)
    rec = reconciler(sessions, tmp_path)
    job_id = insert_job(sessions, job_document("long", args=["--steps", "1000", "--step-s", "0.1", "--child"]))
    drive(rec, sessions, job_id, {"RUNNING"})
    run = f"df-long-{job_id[:8]}-a0"
    pids = _marked(run)
    assert pids
    with sessions() as s, s.begin():
        s.get(Job, job_id).desired_state = "cancel_requested"
    final = drive(rec, sessions, job_id, {"CANCELLED"})
    assert final.phase == "CANCELLED" and events(sessions, job_id)[-1] == "Cancelled"
    assert [p for p in pids if _alive(p)] == []


def test_admission_respects_capacity_quota_and_rejects_what_never_fits(tmp_path: Path) -> None:
    sessions = sqlite(tmp_path)
    rec = reconciler(sessions, tmp_path, slots=4)
    t0 = datetime.now(timezone.utc)
    long = ["--steps", "1000", "--step-s", "0.1"]
    a = insert_job(sessions, job_document("a", args=long), created=t0)
    b = insert_job(sessions, job_document("b", args=long), created=t0 + timedelta(seconds=1))
    c = insert_job(sessions, job_document("c", args=long), created=t0 + timedelta(seconds=2))
    huge = insert_job(sessions, job_document("huge", args=long, nodes=5))
    over = insert_job(sessions, job_document("over", args=long, nodes=3, queue="small"))
    rec.reconcile_once(t0 + timedelta(seconds=3))
    assert [job(sessions, j).phase for j in (a, b, c)] == ["ADMITTED", "ADMITTED", "PENDING"]
    assert job(sessions, c).message.startswith("next in line: waiting for 2 processes")
    assert job(sessions, huge).phase == "FAILED" and "more than the backend has" in job(sessions, huge).message
    assert job(sessions, over).phase == "FAILED" and "queue 'small'" in job(sessions, over).message
    for j in (a, b, c):
        with sessions() as s, s.begin():
            s.get(Job, j).desired_state = "cancel_requested"
    for j in (a, b, c):
        drive(rec, sessions, j, {"CANCELLED"})


def test_crash_after_submit_intent_resubmits_the_same_name_once(tmp_path: Path) -> None:
    """A controller died after committing the intent but before the backend call: the next owner sees
    NOT_FOUND and submits the same run name, once."""
    sessions = sqlite(tmp_path)
    job_id = insert_job(sessions, job_document("intent", args=["--steps", "2"]))
    run = f"df-intent-{job_id[:8]}-a0"
    with sessions() as s, s.begin():
        j = s.get(Job, job_id)
        j.phase, j.claimed_by = "ADMITTED", "dead-replica"
        j.claim_expires_at = datetime.now(timezone.utc) - timedelta(seconds=1)
        s.add(Attempt(job_id=job_id, number=0, backend="local", run_name=run, phase="PENDING", exit_codes={}))
    rec = reconciler(sessions, tmp_path, replica="r2")
    final = drive(rec, sessions, job_id, {"SUCCEEDED", "FAILED"})
    assert final.phase == "SUCCEEDED" and "Resubmitted" in events(sessions, job_id)
    assert starts(tmp_path, run) == 1


def test_crash_after_backend_submit_before_commit_adopts_the_run(tmp_path: Path) -> None:
    """The backend got the run but the controller died before recording it: the run is adopted, not doubled."""
    sessions = sqlite(tmp_path)
    job_id = insert_job(sessions, job_document("adopt", args=["--steps", "20", "--step-s", "0.05"]))
    rec = reconciler(sessions, tmp_path, replica="r2")
    with sessions() as s, s.begin():
        j = s.get(Job, job_id)
        j.phase = "ADMITTED"
        sub = compile_submission(JobSpec.model_validate(j.spec), job_id=job_id, attempt=0,
                                 controller_url="http://127.0.0.1:9", secret="s")
        s.add(Attempt(job_id=job_id, number=0, backend="local", run_name=sub.name, phase="PENDING", exit_codes={}))
    rec.backend.submit(sub)  # the submit that happened just before the crash
    final = drive(rec, sessions, job_id, {"SUCCEEDED", "FAILED"})
    assert final.phase == "SUCCEEDED"
    assert starts(tmp_path, sub.name, 0) == starts(tmp_path, sub.name, 1) == 1


def test_two_replicas_on_one_database_run_each_job_exactly_once(tmp_path: Path) -> None:
    sessions = sqlite(tmp_path)
    ids = [insert_job(sessions, job_document(f"j{i}", args=["--steps", "3"], nodes=1)) for i in range(6)]
    replicas = [reconciler(sessions, tmp_path, replica=f"r{i}") for i in range(2)]
    run_replicas_until_succeeded(replicas, sessions, ids, interval_s=0.05)
    assert [job(sessions, j).phase for j in ids] == ["SUCCEEDED"] * 6
    for i, j in enumerate(ids):
        assert starts(tmp_path, f"df-j{i}-{j[:8]}-a0") == 1
        assert events(sessions, j).count("Submitted") == 1
    with sessions() as s:
        assert len(list(s.scalars(select(Attempt)))) == 6


def test_a_stored_spec_that_no_longer_validates_fails_the_job_with_one_line_per_field(tmp_path: Path) -> None:
    sessions = sqlite(tmp_path)
    rec = reconciler(sessions, tmp_path)
    job_id = insert_job(sessions, job_document("factory"))
    with sessions() as s, s.begin():  # as an older version stored it: factory args as key=value strings
        row = s.get(Job, job_id)
        row.spec = {**row.spec, "spec": {**row.spec["spec"], "maxSteps": 5, "entrypoint": {
            "factory": "examples.gpt.factories:build", "args": ["steps=3"]}}}
    final = drive(rec, sessions, job_id, {"FAILED", "SUCCEEDED"})
    assert final.phase == "FAILED"
    assert final.message == ("spec.entrypoint.args: factory args are a mapping now, not key=value strings; "
                             "write args: {steps: 3}")
    assert events(sessions, job_id)[-1] == "InvalidSpec"


def test_an_elastic_job_that_loses_a_node_carries_on_and_says_so(tmp_path: Path) -> None:
    sessions = sqlite(tmp_path)
    rec = reconciler(sessions, tmp_path)
    doc = job_document("elastic", args=["--steps", "12", "--step-s", "0.1", "--fail-node", "1", "--fail-code", "137",
                                        "--fail-at-step", "2"], nodes={"min": 1, "max": 2})
    job_id = insert_job(sessions, doc)
    final = drive(rec, sessions, job_id, {"SUCCEEDED", "FAILED"})
    assert final.phase == "SUCCEEDED" and final.current_attempt == 0
    assert "Degraded" in events(sessions, job_id)


def test_a_job_whose_heartbeats_stop_is_restarted_as_hung(tmp_path: Path) -> None:
    sessions = sqlite(tmp_path)
    rec = reconciler(sessions, tmp_path)
    job_id = insert_job(sessions, job_document("hang", args=["--steps", "1000", "--step-s", "0.1"], nodes=1))
    t0 = datetime.now(timezone.utc)
    drive(rec, sessions, job_id, {"RUNNING"}, now=lambda: t0)
    with sessions() as s, s.begin():  # what the API records when rank 0 posts a heartbeat
        s.get(Job, job_id).last_heartbeat_at = t0 + timedelta(seconds=1)
    rec.reconcile_once(t0 + timedelta(seconds=1000))
    assert job(sessions, job_id).phase == "RUNNING"
    rec.reconcile_once(t0 + timedelta(seconds=1802))
    hung = job(sessions, job_id)
    assert hung.phase == "RESTARTING" and hung.restart_counts == {"comm_failure": 1}
    assert "presumed hung" in hung.message
    assert _marked(f"df-hang-{job_id[:8]}-a0") == []
    with sessions() as s, s.begin():
        s.get(Job, job_id).desired_state = "cancel_requested"
    drive(rec, sessions, job_id, {"CANCELLED"}, now=lambda: t0 + timedelta(seconds=1900))


def test_one_scheduler_lease_holder_at_a_time(tmp_path: Path) -> None:
    sessions = sqlite(tmp_path)
    a, b = reconciler(sessions, tmp_path, replica="a", lease_seconds=10), reconciler(sessions, tmp_path, replica="b")
    t0 = datetime.now(timezone.utc)
    assert a._hold_lease("scheduler-local", t0) and not b._hold_lease("scheduler-local", t0)
    assert a._hold_lease("scheduler-local", t0 + timedelta(seconds=5))  # renewed by its holder
    assert not b._hold_lease("scheduler-local", t0 + timedelta(seconds=14))
    assert b._hold_lease("scheduler-local", t0 + timedelta(seconds=16))  # expired: taken over
    assert not a._hold_lease("scheduler-local", t0 + timedelta(seconds=17))
