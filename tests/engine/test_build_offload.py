"""Offload sections: CPU offload is accepted when training on the CPU (states already live in host
memory); CPU and NVMe offload are refused by name on an accelerator, where moving optimizer state off the
device is not implemented yet. NVMe offload on the CPU: test_nvme_offload.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepfleet.engine.build import build_training
from deepfleet.engine.config import load_config


def _config(section: str, device: str = "cpu") -> object:
    extra = {"nvme_path": "/nonexistent"} if device == "nvme" else {}
    return load_config({
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, section: {"device": device, **extra}},
    })


class _OnMeta(nn.Module):
    """A model whose parameters sit on a non-CPU device (meta stands in for an accelerator)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(2, device="meta"))


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
def test_offload_on_an_accelerator_is_refused_by_name(section: str) -> None:
    with pytest.raises(ValueError, match=rf"zero_optimization\.{section}\.device: .*not supported yet"):
        build_training(_OnMeta(), _config(section))


def test_nvme_optimizer_offload_on_an_accelerator_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^zero_optimization\.offload_optimizer\.device: nvme offload while training "
                                         r"on meta is not supported yet"):
        build_training(_OnMeta(), _config("offload_optimizer", "nvme"))
