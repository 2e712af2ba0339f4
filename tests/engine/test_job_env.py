"""A script run by a deepfleet job gets the spec's engine config when it passes none to initialize;
outside a job nothing changes (config stays required)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from torch import nn

from deepfleet.engine import initialize, job_env


@pytest.fixture()
def one_rank():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_initialize_reads_the_jobs_engine_config_when_the_script_passes_none(monkeypatch, one_rank) -> None:
    monkeypatch.setenv(job_env.ENGINE_CONFIG_ENV, json.dumps(
        {"train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}))
    engine, optimizer, _, _ = initialize(model=nn.Linear(4, 2))
    assert engine.config.train_micro_batch_size_per_gpu == 3
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_outside_a_job_the_config_is_still_required(monkeypatch) -> None:
    monkeypatch.delenv(job_env.ENGINE_CONFIG_ENV, raising=False)
    with pytest.raises(ValueError, match="config: required"):
        initialize(model=nn.Linear(4, 2))


def test_the_step_budget_and_checkpoint_dir_are_read_as_set() -> None:
    env = {job_env.MAX_STEPS_ENV: "12", job_env.CHECKPOINT_DIR_ENV: "/ck"}
    assert (job_env.max_steps(env), job_env.checkpoint_dir(env), job_env.checkpoint_every_steps(env)) == (12, "/ck", None)
    with pytest.raises(ValueError, match="DEEPFLEET_MAX_STEPS='x' is not an integer"):
        job_env.max_steps({job_env.MAX_STEPS_ENV: "x"})
