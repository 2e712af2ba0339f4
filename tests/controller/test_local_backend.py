"""The local backend with real subprocesses (the fake worker): start, observe, fail, cancel, restart-safety."""

from __future__ import annotations

import gc
import json
import time
import warnings
from pathlib import Path

import pytest

from deepfleet.controller.backends.base import Backend, BackendError, RunPhase
from deepfleet.controller.backends.local import LocalBackend, _alive, _marked
from deepfleet.controller.compile import compile_submission
from deepfleet.controller.spec import validate_job
from deepfleet.worker.spec import FailureClass
from tests.controller.jobspecs import FAKE_WORKER, job_document, job_spec


def backend(tmp_path: Path) -> LocalBackend:
    return LocalBackend(tmp_path / "logs", slots=4, workdir=tmp_path, worker_command=FAKE_WORKER, cancel_grace_s=2)


def submission(name: str, args: list[str], *, attempt: int = 0, **kw):
    return compile_submission(job_spec(name, args=args, **kw), job_id="0123456789abcdef", attempt=attempt,
                              controller_url="http://127.0.0.1:9", secret="s")


def wait_for(be: LocalBackend, name: str, phases: set[RunPhase], timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        obs = be.observe(name)
        if obs.phase in phases:
            return obs
        time.sleep(0.05)
    raise AssertionError(f"{name} never reached {phases}; last {obs}")


def test_two_nodes_run_to_success_with_logs_per_node(tmp_path: Path) -> None:
    be = backend(tmp_path)
    assert isinstance(be, Backend)
    sub = submission("ok", ["--steps", "3"])
    assert sub.name == "df-ok-01234567-a0"
    be.submit(sub)
    be.submit(sub)  # idempotent: no second set of processes
    obs = wait_for(be, sub.name, {RunPhase.SUCCEEDED, RunPhase.FAILED})
    assert obs.phase is RunPhase.SUCCEEDED and obs.exit_codes == {0: 0, 1: 0}
    for node in (0, 1):
        log = (tmp_path / "logs" / sub.name / f"node-{node}.log").read_text()
        port_file = Path(json.loads((be.run_dir(sub.name) / "state.json").read_text())["port_file"])
        assert log.count(f"fake worker node {node} attempt 0 rendezvous 127.0.0.1:0 {port_file}") == 1
        assert "done" in log
    assert list(be.logs(sub.name, node=1, tail=1)) == ["done\n"]


@pytest.mark.parametrize(("code", "fc"), [(76, FailureClass.COMM_FAILURE), (77, FailureClass.OOM),
                                          (64, FailureClass.INVALID_SPEC), (137, FailureClass.NODE_LOST)])
def test_a_failing_node_fails_the_run_with_its_class(tmp_path: Path, code: int, fc: FailureClass) -> None:
    be = backend(tmp_path)
    sub = submission("bad", ["--steps", "50", "--fail-node", "1", "--fail-code", str(code), "--fail-at-step", "1"])
    be.submit(sub)
    obs = wait_for(be, sub.name, {RunPhase.FAILED, RunPhase.SUCCEEDED})
    assert obs.phase is RunPhase.FAILED and obs.failure_class is fc and obs.exit_codes[1] == code
    assert "node 1 exited" in obs.message
    be.cancel(sub.name)


def test_cancel_kills_every_process_including_new_session_children(tmp_path: Path) -> None:
    be = backend(tmp_path)
    sub = submission("long", ["--steps", "1000", "--step-s", "0.1", "--child"])
    be.submit(sub)
    wait_for(be, sub.name, {RunPhase.RUNNING})
    deadline = time.monotonic() + 10
    while len(_marked(sub.name)) < 4 and time.monotonic() < deadline:  # 2 wrappers + 2 workers + 2 children
        time.sleep(0.05)
    pids = _marked(sub.name)
    assert len(pids) >= 4
    be.cancel(sub.name)
    assert [p for p in pids if _alive(p)] == []
    assert be.observe(sub.name).phase is RunPhase.NOT_FOUND
    be.cancel(sub.name)  # idempotent


def test_a_new_backend_instance_observes_and_cancels_runs_of_a_previous_one(tmp_path: Path) -> None:
    first = backend(tmp_path)
    sub = submission("survive", ["--steps", "1000", "--step-s", "0.1"])
    first.submit(sub)
    wait_for(first, sub.name, {RunPhase.RUNNING})
    second = backend(tmp_path)  # a restarted controller: not the parent of these processes
    assert second.observe(sub.name).phase is RunPhase.RUNNING
    second.submit(sub)  # idempotent across instances too
    pids = _marked(sub.name)
    second.cancel(sub.name)
    for proc in first._children.values():  # the old instance is still the parent: reap
        proc.wait(timeout=5)
    assert [p for p in pids if _alive(p)] == []


def test_exit_status_survives_the_controller(tmp_path: Path) -> None:
    first = backend(tmp_path)
    sub = submission("fin", ["--steps", "1", "--exit", "65"])
    first.submit(sub)
    wait_for(first, sub.name, {RunPhase.FAILED})
    assert backend(tmp_path).observe(sub.name).failure_class is FailureClass.USER_ERROR
    first.cancel(sub.name)  # the other node may still be finishing; the parent reaps it


def test_a_dropped_backend_leaves_no_uncollected_child_behind(tmp_path: Path) -> None:
    """A run started by one replica and seen finished by another: the starter never observes it, and
    dropping it must neither leave a zombie nor warn that a subprocess is still running."""
    first, second = backend(tmp_path), backend(tmp_path)
    done = submission("done", ["--steps", "1"], nodes=1)
    running = submission("long", ["--steps", "1000", "--step-s", "0.1"], nodes=1)
    first.submit(done)
    first.submit(running)
    wait_for(second, done.name, {RunPhase.SUCCEEDED})
    pids = list(first._children)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        del first
        gc.collect()
    second.cancel(running.name)
    second.observe(done.name)  # any backend's entry point collects the orphans' exits
    assert [p for p in pids if Path(f"/proc/{p}").exists()] == []  # neither running nor a zombie


def test_unknown_run_is_not_found(tmp_path: Path) -> None:
    assert backend(tmp_path).observe("df-nope-00000000-a0").phase is RunPhase.NOT_FOUND


def test_a_start_cut_short_by_a_crash_is_not_found_and_restarts_cleanly(tmp_path: Path) -> None:
    be = backend(tmp_path)
    sub = submission("cut", ["--steps", "1000", "--step-s", "0.1"])
    be.submit(sub)
    wait_for(be, sub.name, {RunPhase.RUNNING})
    state_file = tmp_path / "logs" / sub.name / "state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "pids": state["pids"][:1], "complete": False}))  # died mid-start
    old = _marked(sub.name)
    restarted = backend(tmp_path)
    assert restarted.observe(sub.name).phase is RunPhase.NOT_FOUND
    restarted.submit(sub)
    assert [p for p in old if _alive(p)] == []  # the half-started nodes were stopped first
    assert restarted.observe(sub.name).phase is RunPhase.RUNNING
    assert (tmp_path / "logs" / sub.name / "node-0.log.interrupted").exists()
    restarted.cancel(sub.name)
    for proc in be._children.values():
        proc.wait(timeout=5)


def test_an_elastic_run_carries_on_while_min_nodes_remain(tmp_path: Path) -> None:
    be = backend(tmp_path)
    sub = submission("elastic", ["--steps", "15", "--step-s", "0.1", "--fail-node", "1", "--fail-code", "137",
                                 "--fail-at-step", "1"], nodes={"min": 1, "max": 2})
    be.submit(sub)
    deadline = time.monotonic() + 20
    while 1 not in be.observe(sub.name).exit_codes and time.monotonic() < deadline:
        time.sleep(0.05)
    obs = be.observe(sub.name)
    assert obs.phase is RunPhase.RUNNING and "continuing on 1 of 2 nodes" in obs.message
    obs = wait_for(be, sub.name, {RunPhase.SUCCEEDED, RunPhase.FAILED})
    assert obs.phase is RunPhase.SUCCEEDED and obs.exit_codes == {0: 0, 1: 137}


def test_a_job_starts_from_an_empty_area_unless_it_resumes_from_a_job_of_its_project(tmp_path: Path) -> None:
    be = backend(tmp_path)
    first = compile_submission(job_spec("ck", args=["--steps", "4"], ckpt="ck"), job_id="aaaa000011112222",
                               attempt=0, controller_url="http://127.0.0.1:9", secret="s")
    be.submit(first)
    assert wait_for(be, first.name, {RunPhase.SUCCEEDED, RunPhase.FAILED}).phase is RunPhase.SUCCEEDED
    again = compile_submission(job_spec("ck", args=["--steps", "4"], ckpt="ck"), job_id="bbbb000011112222",
                               attempt=0, controller_url="http://127.0.0.1:9", secret="s")
    be.submit(again)  # the same name: its own, empty checkpoint dir
    wait_for(be, again.name, {RunPhase.SUCCEEDED, RunPhase.FAILED})
    assert "resuming" not in "".join(be.logs(again.name))
    doc = job_document("ck", args=["--steps", "6"], ckpt="ck")
    doc["spec"]["checkpoint"]["resumeFrom"] = "aaaa000011112222"
    resumed = compile_submission(validate_job(doc), job_id="cccc000011112222", attempt=0,
                                 controller_url="http://127.0.0.1:9", secret="s")
    be.submit(resumed)
    assert wait_for(be, resumed.name, {RunPhase.SUCCEEDED, RunPhase.FAILED}).phase is RunPhase.SUCCEEDED
    assert "resuming from global_step4" in "".join(be.logs(resumed.name))
    source = be.jobs_dir / "test" / "aaaa000011112222" / "checkpoints" / "ck"
    assert (source / "latest").read_text().strip() == "global_step4"  # the source is left as it was


def test_a_missing_secret_fails_the_submit_permanently_naming_the_reference(tmp_path: Path) -> None:
    doc = job_document("needs-secret", nodes=1)
    doc["spec"]["env"] = {"HF_TOKEN": {"secret": "hf"}}
    sub = compile_submission(validate_job(doc), job_id="0123456789abcdef", attempt=0,
                             controller_url="http://127.0.0.1:9", secret="s")

    def store(project: str, name: str) -> str:
        raise LookupError(f"secret {name!r} is not in project {project!r}'s secret store; set it")

    for secrets, reason in ((None, "has no secret store"), (store, "spec.env.HF_TOKEN: secret 'hf' is not in")):
        be = LocalBackend(tmp_path / "logs", slots=1, workdir=tmp_path, worker_command=FAKE_WORKER, secrets=secrets)
        with pytest.raises(BackendError, match=reason) as err:
            be.submit(sub)
        assert not err.value.transient and be.observe(sub.name).phase is RunPhase.NOT_FOUND
