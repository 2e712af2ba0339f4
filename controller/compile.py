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

from deepfleet.controller.backends.base import Submission, run_name
from deepfleet.controller.sources import CheckpointSource
from deepfleet.controller.spec import AnyJob, is_serving, node_bounds, plain_env
from deepfleet.controller.tokens import job_token
from deepfleet.worker.spec import (
    ATTEMPT_ENV,
    HEARTBEAT_URL_ENV,
    JOB_ID_ENV,
    SPEC_ENV,
    TOKEN_ENV,
    ModelExport,
    Nodes,
    WorkerSpec,
)

HEARTBEAT_PATH = "/v1/jobs/{job_id}/heartbeat"
FAILURE_PATH = "/v1/jobs/{job_id}/failure"


def worker_spec(spec: AnyJob, *, job_id: str, attempt: int) -> WorkerSpec:
    """The WorkerSpec of one attempt (no secrets: the token travels in the environment only). A ServingJob
    compiles to the same contract: its factory as the entrypoint, the named job's checkpoint as
    `checkpoint.resumeFrom` (copied into its own area by the local backend, mounted read-only by the
    kubernetes and azureml backends from `checkpoint_source`) and `serve` set.

    The entrypoint, checkpoint, restart policy and step budget are the JobSpec's own section objects
    (the same models); what is added here is placement: job id, attempt, platform and node range."""
    s = spec.spec
    low, high = node_bounds(spec)
    return WorkerSpec(
        job_id=job_id,
        attempt=attempt,
        entrypoint=s.entrypoint,
        engine_config=s.engine,
        platform=s.backend,
        nodes=Nodes(min=low, max=high),
        processes_per_node=s.processes_per_node,
        checkpoint=s.checkpoint,
        restart=s.restart_policy,
        max_steps=s.max_steps,
        export=ModelExport(dtype=s.register_model.dtype) if s.register_model is not None else None,
        env=plain_env(spec),  # secret references are resolved by the backend, never put in the spec
        serve=spec.spec.serve_options() if is_serving(spec) else None,  # type: ignore[union-attr]
    )


def compile_submission(
    spec: AnyJob,
    *,
    job_id: str,
    attempt: int,
    controller_url: str,
    secret: str,
    heartbeat_interval_s: float | None = None,
    checkpoint_source: CheckpointSource | None = None,
) -> Submission:
    """Everything a backend needs to start attempt `attempt` of job `job_id`. `checkpoint_source`: the stored
    record of the job `checkpoint.resumeFrom` names (`sources.checkpoint_source`), for the backends that
    mount its checkpoints instead of copying them."""
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
        checkpoint_source=checkpoint_source,
    )
