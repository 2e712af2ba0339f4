"""Factories for the managed-loop tests: the example GPT, optionally slowed down per forward so a test
can signal or kill a training process mid-run, or a factory that fails."""

from __future__ import annotations

import time

import torch

from deepfleet.worker.train import ManagedJob
from examples.gpt.factories import build as build_gpt


class _Slow(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module, sleep_s: float) -> None:
        super().__init__()
        self.inner = inner
        self.sleep_s = sleep_s

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return self.inner(batch)


def slow_gpt(*, sleep_s: float = 0.0, **kwargs: int) -> ManagedJob:
    job = build_gpt(**kwargs)
    job.model = _Slow(job.model, sleep_s)
    return job


def broken(**kwargs: int) -> ManagedJob:
    raise KeyError("vocab_size missing from the tokenizer config")


def pipeline_mlp(*, num_stages: int = 2, num_samples: int = 64) -> ManagedJob:
    """The pipeline tests' tied MLP as a PipelineModule of `num_stages` stages over (inputs, labels) pairs."""
    from tests.engine.pipe.pipe_runs import data, make_model

    x, y = data(1, num_samples)[0]
    return ManagedJob(model=make_model(num_stages), training_data=torch.utils.data.TensorDataset(x, y))
