"""`OneBitAdam`, `ZeroOneAdam` and `OneBitLamb` through `deepfleet.engine.initialize` on 2 gloo ranks with
the peer GPT: DeepSpeed configs are accepted as written, the wire bytes per step counted by
`engine/comm.py` drop to <= 1/20 of Adam's after the warm-up, and the loss stays close to Adam's
(and 1-bit LAMB's to LAMB's) over 150 steps."""

from __future__ import annotations

import pytest

from deepfleet.engine.config import ConfigError, load_config
from tests.engine.onebit.onebit_runs import FREEZE, runs

# DeepSpeed's documented configs (tutorials and docs), unchanged.
DEEPSPEED_CONFIGS = {
    "OneBitAdam": {"lr": 4e-4, "freeze_step": 23000, "cuda_aware": False, "comm_backend_name": "nccl"},
    "ZeroOneAdam": {"lr": 1e-3, "weight_decay": 0.01, "bias_correction": False, "var_freeze_step": 1000,
                    "var_update_scaler": 16, "local_step_scaler": 1000, "local_step_clipper": 16,
                    "cuda_aware": False, "comm_backend_name": "nccl"},
    "OneBitLamb": {"lr": 11e-3, "weight_decay": 0.01, "bias_correction": False, "max_coeff": 0.3,
                   "min_coeff": 0.01, "freeze_step": 1000, "cuda_aware": False, "comm_backend_name": "nccl",
                   "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1},
}


@pytest.mark.parametrize("name", sorted(DEEPSPEED_CONFIGS))
def test_deepspeed_configs_are_accepted_as_written(name: str) -> None:
    cfg = load_config({"train_batch_size": 4096, "train_micro_batch_size_per_gpu": 16, "steps_per_print": 100,
                       "optimizer": {"type": name.lower(), "params": DEEPSPEED_CONFIGS[name]},
                       "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}}, world_size=256)
    assert cfg.optimizer.type == name
    assert cfg.optimizer.params.model_dump(exclude_defaults=True).keys() <= DEEPSPEED_CONFIGS[name].keys()


def _error(optimizer: dict, stage: int = 0) -> str:
    with pytest.raises(ConfigError) as e:
        load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
                     "optimizer": optimizer})
    return str(e.value)


def test_bad_one_bit_configs_name_the_key() -> None:
    assert "optimizer.params.amsgrad: the 1-bit optimizers do not support AMSGrad" in _error(
        {"type": "OneBitAdam", "params": {"amsgrad": True}})
    assert "optimizer.params.freeze_step: must be >= 0" in _error({"type": "OneBitAdam", "params": {"freeze_step": -1}})
    assert "factor_min: 5.0 > factor_max 4.0" in _error({"type": "OneBitLamb", "params": {"factor_min": 5.0}})
    assert "optimizer.type: OneBitAdam reduces gradients itself and needs zero_optimization.stage 0 (got 2)" in _error(
        {"type": "OneBitAdam"}, stage=2)


def test_wire_bytes_after_warmup_are_at_most_a_twentieth_of_adams() -> None:
    out = runs(2, FREEZE + 10)
    adam = out["Adam"]["bytes"]
    assert len(set(adam)) == 1  # every Adam step all-reduces the same fp32 gradients
    for name in ("OneBitAdam", "OneBitLamb"):
        warm, late = out[name]["bytes"][:FREEZE], out[name]["bytes"][FREEZE:]
        assert warm == adam[:FREEZE]  # warm-up: the same fp32 reduction
        assert len(set(late)) == 1 and late[0] * 20 <= adam[0], (name, late[0], adam[0])
    # 0/1 Adam: after var_freeze_step, compressed syncs (or local steps with no traffic) only
    late = out["ZeroOneAdam"]["bytes"][FREEZE:]
    assert max(late) * 20 <= adam[0]
    assert sum(out["ZeroOneAdam"]["bytes"][:FREEZE]) < sum(adam[:FREEZE])  # variance updates are sparse


@pytest.mark.slow
def test_losses_stay_close_to_the_full_precision_optimizers() -> None:
    out = runs(2, 150)

    def tail(name: str) -> float:  # mean loss over the last 20 steps
        return sum(out[name]["loss"][-20:]) / 20

    assert out["Adam"]["loss"][0] > 1.5 * tail("Adam")  # it learns
    assert tail("OneBitAdam") <= 1.03 * tail("Adam")
    assert tail("ZeroOneAdam") <= 1.06 * tail("Adam")
    assert tail("OneBitLamb") <= 1.35 * tail("Lamb")
    assert tail("OneBitLamb") <= tail("Adam")
