"""Opt-in: another job's checkpoint in a real Azure ML workspace. Run (after `az login`) with

    AZURE_SUBSCRIPTION_ID=... AZURE_RESOURCE_GROUP=... AZUREML_WORKSPACE=... AZUREML_COMPUTE=<cluster> \
    DEEPFLEET_E2E_IMAGE=<worker image the workspace can pull> \
        pytest -m azure tests/e2e_cloud/test_azureml_checkpoint_real.py

Optional: DEEPFLEET_AZUREML_DATASTORE (default: the workspace's default blob store). The example job
trains 40 steps into its `checkpoints` output (a fixed folder of the datastore); a second training job
names it in `checkpoint.resumeFrom`, gets that folder as a read-only input, starts at step 40 from a copy
in its own output and trains to 50; a ServingJob names the first in `model.job`, gets the same folder as
a read-only input and loads the newest complete checkpoint there (its log says it serves it). This checks
what the fake transport cannot: that ARM accepts the input and output bindings, that Azure mounts them
where `${{inputs.checkpoint}}` / `${{outputs.checkpoints}}` say, and that the read-only mount is readable.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings

import pytest

from deepfleet.controller.backends.base import BackendError, RunPhase, Submission
from deepfleet.controller.compile import compile_submission
from deepfleet.controller.sources import checkpoint_source
from deepfleet.controller.spec import validate_job
from tests.controller.example_jobs import example_document, serving_document
from tests.e2e_cloud.test_azureml_real import ENV, wait

pytestmark = [
    pytest.mark.azure,
    pytest.mark.skipif(not all(os.environ.get(k) for k in ENV), reason=f"set {', '.join(ENV)} to run against Azure ML"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]
ENV_VARS = {"OMP_NUM_THREADS": "1", "PYTHONPATH": "/opt/deepfleet"}


@pytest.fixture()
def backend():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from deepfleet.controller.backends.azureml import from_env

        return from_env(os.environ)


def _options() -> dict:
    return {"compute": os.environ["AZUREML_COMPUTE"], "experimentName": "deepfleet-e2e"}


def _compile(doc: dict, source: Submission | None = None) -> Submission:
    where = None if source is None else checkpoint_source(source.job_id, project=source.spec.metadata.project,
                                                          backend="azureml", document=source.spec.to_document())
    return compile_submission(validate_job(doc), job_id=uuid.uuid4().hex, attempt=0, secret="e2e",
                              controller_url="http://deepfleet.example:8000", checkpoint_source=where)


def _training(**overrides) -> dict:
    return example_document("azureml", image=os.environ["DEEPFLEET_E2E_IMAGE"], azureml=_options(), env=ENV_VARS,
                            **overrides)


def _finish(backend, sub: Submission) -> str:
    backend.submit(sub)
    try:
        obs = wait(backend, sub.name, {RunPhase.SUCCEEDED, RunPhase.FAILED}, timeout=1800)
        assert obs.phase is RunPhase.SUCCEEDED, obs.message
        return "".join(backend.logs(sub.name, node=0))
    finally:
        backend.cancel(sub.name)


def test_a_job_resumes_and_a_serving_job_serves_another_jobs_checkpoint(backend) -> None:
    trained = _compile(_training(checkpoint={"dir": "ck", "everySteps": 10}))
    _finish(backend, trained)

    resumed = _compile(_training(maxSteps=50, checkpoint={"dir": "ck", "resumeFrom": trained.job_id}), trained)
    log = _finish(backend, resumed)
    assert "starting at step 40/50 from checkpoint global_step40" in log, log

    doc = serving_document(backend="azureml", image=os.environ["DEEPFLEET_E2E_IMAGE"], azureml=_options(),
                           env=ENV_VARS)
    doc["spec"]["model"] = {"job": trained.job_id, "factory": "examples.gpt.factories:build",
                            "args": {"num_samples": 4096}}
    served = _compile(doc, trained)
    backend.submit(served)
    try:
        wait(backend, served.name, {RunPhase.RUNNING}, timeout=1800)
        deadline, log = time.monotonic() + 600, ""
        while "/v1/completions" not in log:
            assert time.monotonic() < deadline, log
            time.sleep(15)
            try:
                log = "".join(backend.logs(served.name, node=0))
            except BackendError as e:  # the log file appears some time after the job runs
                log = str(e)
        assert backend.observe(served.name).phase is RunPhase.RUNNING
    finally:
        backend.cancel(served.name)
