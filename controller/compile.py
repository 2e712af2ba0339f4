"""Compile one attempt of a job (JobSpec + attempt) into what a backend runs: a Submission holding the
WorkerSpec every node receives and the worker environment.

Called by `controller.reconciler` before `Backend.submit`. Pure: the same job, attempt and secret
always compile to the same Submission, which is what makes resubmission after a crash idempotent.
Each worker gets the job-scoped token (`controller.tokens.job_token`, an HMAC of the job id) in
`DEEPFLEET_TOKEN` only, never inside the stored WorkerSpec.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from deepfleet.controller.backends.base import Submission, run_name
from deepfleet.controller.spec import FactoryEntrypoint, JobSpec, node_bounds
from deepfleet.controller.tokens import job_token
from deepfleet.worker.spec import (
    ATTEMPT_ENV,
    HEARTBEAT_URL_ENV,
    JOB_ID_ENV,
    SPEC_ENV,
    TOKEN_ENV,
    WorkerSpec,
)

HEARTBEAT_PATH = "/v1/jobs/{job_id}/heartbeat"
FAILURE_PATH = "/v1/jobs/{job_id}/failure"


def _factory_kwargs(entry: FactoryEntrypoint) -> tuple[dict[str, Any], int | None]:
    """A factory's `args` are `key=value` strings (values read as YAML scalars); `max_steps=N` is the
    managed loop's step count rather than a factory argument."""
    kwargs: dict[str, Any] = {}
    for i, arg in enumerate(entry.args):
        key, sep, value = arg.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"spec.entrypoint.args[{i}]: {arg!r} is not key=value; write factory args like steps=50")
        kwargs[key] = yaml.safe_load(value)
    max_steps = kwargs.pop("max_steps", None)
    return kwargs, (int(max_steps) if max_steps is not None else None)


def worker_spec(spec: JobSpec, *, job_id: str, attempt: int) -> WorkerSpec:
    """The WorkerSpec of one attempt (no secrets: the token travels in the environment only)."""
    s = spec.spec
    low, high = node_bounds(spec)
    entry: dict[str, Any]
    max_steps = None
    if isinstance(s.entrypoint, FactoryEntrypoint):
        kwargs, max_steps = _factory_kwargs(s.entrypoint)
        entry = {"factory": s.entrypoint.factory, "kwargs": kwargs}
    else:
        entry = {"script": s.entrypoint.script, "args": list(s.entrypoint.args)}
    checkpoint: dict[str, Any] = {}
    if s.checkpoint is not None:
        checkpoint = {
            "dir": s.checkpoint.dir,
            "every_steps": s.checkpoint.every_steps or 0,
            "keep_last": s.checkpoint.keep_last,
        }
    return WorkerSpec.model_validate(
        {
            "job_id": job_id,
            "attempt": attempt,
            "entrypoint": entry,
            "engine_config": s.engine,
            "platform": s.backend,
            "nodes": {"min": low, "max": high},
            "processes_per_node": s.processes_per_node,
            "checkpoint": checkpoint,
            "max_steps": max_steps,
            "env": dict(s.env),
        }
    )


def compile_submission(
    spec: JobSpec,
    *,
    job_id: str,
    attempt: int,
    controller_url: str,
    secret: str,
    heartbeat_interval_s: float | None = None,
) -> Submission:
    """Everything a backend needs to start attempt `attempt` of job `job_id`."""
    base = controller_url.rstrip("/")
    heartbeat_url = base + HEARTBEAT_PATH.format(job_id=job_id)
    ws = worker_spec(spec, job_id=job_id, attempt=attempt)
    hb: dict[str, Any] = {"url": heartbeat_url, "failure_url": base + FAILURE_PATH.format(job_id=job_id)}
    if heartbeat_interval_s is not None:
        hb["interval_s"] = heartbeat_interval_s
    ws = ws.model_copy(update={"heartbeat": ws.heartbeat.model_copy(update=hb)})
    env = {
        JOB_ID_ENV: job_id,
        ATTEMPT_ENV: str(attempt),
        HEARTBEAT_URL_ENV: heartbeat_url,
        TOKEN_ENV: job_token(secret, job_id),
        # Unset keys stay out, so the worker fills them from its environment (the token above).
        SPEC_ENV: json.dumps(ws.model_dump(mode="json", exclude_none=True)),
    }
    return Submission(
        name=run_name(spec.metadata.name, job_id, attempt),
        job_id=job_id,
        attempt=attempt,
        spec=spec,
        worker_spec=ws,
        env=env,
    )
