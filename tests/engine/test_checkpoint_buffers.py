"""A model's state beyond its trainable parameters (persistent buffers such as BatchNorm's running
statistics or an MoE gate's balancing bias, and frozen parameters) is saved and restored at every ZeRO
stage, and loads across stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import deepfleet.engine as deepspeed

pytestmark = pytest.mark.usefixtures("one_rank_group")


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.BatchNorm1d(8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.frozen(self.norm(self.inp(x))))).pow(2).mean()


def _engine(stage: int):  # noqa: ANN202
    torch.manual_seed(0)
    model = Normed()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    return deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                config=config)[0]


def _state(engine) -> dict[str, torch.Tensor]:  # noqa: ANN001
    return {k: v.clone() for k, v in engine.module.state_dict().items() if k.startswith(("norm.", "frozen."))}


@pytest.mark.parametrize(("save_stage", "load_stage"), [(0, 0), (1, 0), (0, 2), (2, 2), (3, 3)])
def test_buffers_and_frozen_parameters_round_trip(tmp_path, save_stage: int, load_stage: int) -> None:
    engine = _engine(save_stage)
    with torch.no_grad():
        engine.module.frozen.weight.mul_(3.0)  # differs from a fresh model's initial value
    for i in range(3):
        engine.backward(engine(torch.randn(4, 6, generator=torch.Generator().manual_seed(i))))
        engine.step()
    saved = _state(engine)
    assert saved["norm.num_batches_tracked"].item() == 3
    engine.save_checkpoint(str(tmp_path))
    resumed = _engine(load_stage)
    assert not torch.equal(_state(resumed)["norm.running_mean"], saved["norm.running_mean"])
    resumed.load_checkpoint(str(tmp_path))
    loaded = _state(resumed)
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
