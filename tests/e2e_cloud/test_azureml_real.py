"""Opt-in: the Azure ML backend against a real workspace. Run (after `az login`) with

    AZURE_SUBSCRIPTION_ID=... AZURE_RESOURCE_GROUP=... AZUREML_WORKSPACE=... AZUREML_COMPUTE=<cluster> \
    DEEPFLEET_E2E_IMAGE=<worker image the workspace can pull> pytest -m azure tests/e2e_cloud/test_azureml_real.py

The example job runs as a two-instance command job with the PyTorch distribution; Azure sets
MASTER_ADDR/NODE_RANK on each instance, the workers meet there and train to the end, and the run is
observed SUCCEEDED. A second run is cancelled once it is queued or running and must end Canceled. This
checks what the fake transport cannot: that ARM accepts the payload, image pulls, and the launcher env.
"""

from __future__ import annotations

import os
import time
import uuid
import warnings

import pytest

from deepfleet.controller.backends.base import RunPhase
from tests.controller.example_jobs import example_submission

ENV = ("AZURE_SUBSCRIPTION_ID", "AZURE_RESOURCE_GROUP", "AZUREML_WORKSPACE", "AZUREML_COMPUTE", "DEEPFLEET_E2E_IMAGE")
pytestmark = [
    pytest.mark.azure,
    pytest.mark.skipif(not all(os.environ.get(k) for k in ENV), reason=f"set {', '.join(ENV)} to run against Azure ML"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture()
def backend():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from deepfleet.controller.backends.azureml import from_env

        return from_env(os.environ)


def submission():
    return example_submission(
        "azureml", job_id=uuid.uuid4().hex, image=os.environ["DEEPFLEET_E2E_IMAGE"],
        azureml={"compute": os.environ["AZUREML_COMPUTE"], "experimentName": "deepfleet-e2e"},
        checkpoint={"dir": "/tmp/deepfleet-e2e", "everySteps": 10},
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": "/opt/deepfleet"})


def wait(backend, name: str, phases: set[RunPhase], *, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        obs = backend.observe(name)
        if obs.phase in phases:
            return obs
        assert time.monotonic() < deadline, f"{name} still {obs.phase}: {obs.message}"
        time.sleep(15)


def test_the_example_job_trains_to_the_end(backend) -> None:
    sub = submission()
    backend.submit(sub)
    try:
        obs = wait(backend, sub.name, {RunPhase.SUCCEEDED, RunPhase.FAILED}, timeout=1800)
        assert obs.phase is RunPhase.SUCCEEDED, obs.message
    finally:
        backend.cancel(sub.name)


def test_cancel_ends_the_run(backend) -> None:
    sub = submission()
    backend.submit(sub)
    backend.cancel(sub.name)
    obs = wait(backend, sub.name, {RunPhase.FAILED, RunPhase.SUCCEEDED}, timeout=600)
    assert obs.phase is RunPhase.FAILED and obs.message.startswith("Canceled")
