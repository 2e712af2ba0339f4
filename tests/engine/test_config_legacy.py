"""DeepSpeed's older spellings and keys real configs still carry, read as DeepSpeed reads them."""

from __future__ import annotations

import pytest

from deepfleet.engine.config import ConfigError, load_config

BASE = {"train_batch_size": 4}


def test_boolean_zero_optimization() -> None:
    assert load_config({**BASE, "zero_optimization": False}).zero_optimization.stage == 0
    assert load_config({**BASE, "zero_optimization": True}).zero_optimization.stage == 1


def test_legacy_cpu_offload_keys() -> None:
    cfg = load_config({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}})
    assert cfg.zero_optimization.offload_optimizer.device == "cpu" and cfg.zero_optimization.offload_optimizer.pin_memory
    cfg = load_config({**BASE, "zero_optimization": {"stage": 3, "cpu_offload": False, "cpu_offload_param": True}})
    assert cfg.zero_optimization.offload_param.device == "cpu"
    assert cfg.zero_optimization.offload_optimizer is None or cfg.zero_optimization.offload_optimizer.device == "none"
    with pytest.raises(ConfigError, match="cpu_offload: true contradicts offload_optimizer.device='nvme'"):
        load_config({**BASE, "zero_optimization": {"stage": 2, "cpu_offload": True,
                                                   "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}})


def test_max_grad_norm_becomes_gradient_clipping() -> None:
    cfg = load_config({**BASE, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}})
    assert cfg.gradient_clipping == 1.0
    cfg = load_config({**BASE, "gradient_clipping": 0.5, "optimizer": {"type": "Lamb", "params": {"max_grad_norm": 0}}})
    assert cfg.gradient_clipping == 0.5


@pytest.mark.parametrize("extra", [
    {"disable_allgather": True},
    {"zero_optimization": {"stage": 3, "stage3_module_granularity_threshold": 5000}},
    {"data_types": {"grad_accum_dtype": "fp32"}},
])
def test_keys_accepted_with_their_meaning(extra: dict) -> None:
    load_config({**BASE, **extra})


def test_grad_accum_dtype_other_than_fp32_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="data_types"):
        load_config({**BASE, "data_types": {"grad_accum_dtype": "bf16"}})
