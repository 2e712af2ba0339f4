"""Compiling a JobSpec attempt into a Submission: deterministic names, the WorkerSpec, the environment."""

from __future__ import annotations

import json

import pytest

from deepfleet.controller.backends.base import run_name
from deepfleet.controller.compile import compile_submission
from deepfleet.controller.spec import validate_job
from deepfleet.controller.tokens import verify_job_token
from deepfleet.worker.spec import FactoryEntrypoint, load_worker_spec
from tests.controller.jobspecs import job_document

JOB_ID = "c0ffee00112233445566778899aabbcc"


def compiled(doc: dict, attempt: int = 0):
    return compile_submission(validate_job(doc), job_id=JOB_ID, attempt=attempt,
                              controller_url="http://ctl:8000/", secret="k", heartbeat_interval_s=2)


def test_same_attempt_compiles_identically_and_attempts_get_new_names() -> None:
    doc = job_document("gpt", args=["--steps", "5"], nodes=2)
    a, b, c = compiled(doc), compiled(doc), compiled(doc, attempt=1)
    assert a == b
    assert (a.name, c.name) == ("df-gpt-c0ffee00-a0", "df-gpt-c0ffee00-a1")
    assert a.worker_spec.nodes.max == 2 and a.worker_spec.platform == "local"


def test_worker_env_carries_a_job_scoped_token_that_is_not_in_the_spec() -> None:
    sub = compiled(job_document("gpt"))
    env = sub.env
    assert env["DEEPFLEET_JOB_ID"] == JOB_ID and env["DEEPFLEET_ATTEMPT"] == "0"
    assert env["DEEPFLEET_HEARTBEAT_URL"] == f"http://ctl:8000/v1/jobs/{JOB_ID}/heartbeat"
    assert verify_job_token("k", JOB_ID, env["DEEPFLEET_TOKEN"])
    assert not verify_job_token("k", "another-job", env["DEEPFLEET_TOKEN"])
    assert env["DEEPFLEET_TOKEN"] not in env["DEEPFLEET_WORKER_SPEC"]
    # what the worker loads from that environment
    ws = load_worker_spec(environ=env)
    assert ws.heartbeat.token == env["DEEPFLEET_TOKEN"] and ws.heartbeat.interval_s == 2
    assert ws.heartbeat.failure_url == f"http://ctl:8000/v1/jobs/{JOB_ID}/failure"


def test_the_jobs_sections_reach_the_worker_unchanged() -> None:
    doc = job_document("gpt", ckpt=None)
    doc["spec"]["entrypoint"] = {"factory": "examples.gpt.factories:build", "args": {"d_model": 64}}
    doc["spec"]["maxSteps"] = 40
    doc["spec"]["checkpoint"] = {"dir": "/ck", "everySteps": 10, "keepLast": 2}
    doc["spec"]["restartPolicy"] = {"maxRestarts": 0, "retryOnUserError": True}
    doc["spec"]["engine"] = {"train_micro_batch_size_per_gpu": 2}
    sub = compiled(doc)
    ws, job = sub.worker_spec, sub.spec.spec
    assert isinstance(ws.entrypoint, FactoryEntrypoint) and ws.entrypoint.args == {"d_model": 64}
    assert ws.max_steps == 40 and ws.engine_config == {"train_micro_batch_size_per_gpu": 2}
    # the same section objects, not translations
    assert (ws.entrypoint, ws.checkpoint, ws.restart) == (job.entrypoint, job.checkpoint, job.restart_policy)
    assert (ws.checkpoint.dir, ws.checkpoint.every_steps, ws.checkpoint.keep_last) == ("/ck", 10, 2)
    assert ws.restart.in_place_budget == 0 and ws.restart.retry_on_user_error
    # and the worker reads back what the backend hands it
    assert load_worker_spec(environ=sub.env) == ws.model_copy(update={
        "heartbeat": ws.heartbeat.model_copy(update={"token": sub.env["DEEPFLEET_TOKEN"]})})


def test_elastic_nodes_and_env_pass_through() -> None:
    doc = job_document("gpt")
    doc["spec"]["nodes"] = {"min": 1, "max": 3}
    doc["spec"]["env"] = {"FOO": "bar"}
    sub = compiled(doc)
    assert (sub.worker_spec.nodes.min, sub.worker_spec.nodes.max) == (1, 3)
    assert json.loads(sub.env["DEEPFLEET_WORKER_SPEC"])["env"] == {"FOO": "bar"}


def test_run_names_are_dns_labels() -> None:
    assert run_name("a" * 40, JOB_ID, 12) == f"df-{'a' * 40}-c0ffee00-a12"
    with pytest.raises(ValueError, match="DNS-1123"):
        run_name("a" * 60, JOB_ID, 0)
