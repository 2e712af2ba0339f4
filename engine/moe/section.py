"""The config's `moe` section as arguments: what a model factory of the managed loop
(`worker/train.py`, e.g. `examples/gpt/factories.py:build_moe`) reads to build its MoE layers the way the
job's engine config says, so one job spec sets the experts and the expert-parallel degree together.
"""

from __future__ import annotations

from typing import Any

from deepfleet.engine.config_moe import MoEConfig


def job_moe_section() -> MoEConfig | None:
    """The `moe` section of this process's job engine config (`DEEPFLEET_WORKER_SPEC`), or None."""
    from deepfleet.engine import job_env
    from deepfleet.engine.config_base import ConfigError
    from deepfleet.engine.config_source import read_source

    source = job_env.engine_config()
    if source is None:
        return None
    errors: list[str] = []
    raw = read_source(source, errors)
    if raw is None:
        raise ConfigError(errors)
    # Only the section: the batch arithmetic needs the world size, which initialize resolves later.
    return MoEConfig.model_validate(raw["moe"]) if raw.get("moe") is not None else None


def layer_kwargs(section: MoEConfig) -> dict[str, Any]:
    """Keyword arguments of `MoE(hidden_size, expert, **kwargs)` from the section."""
    return {
        "num_experts": section.num_experts, "ep_size": section.ep_size, "k": section.k,
        "capacity_factor": section.capacity_factor, "eval_capacity_factor": section.eval_capacity_factor,
        "min_capacity": section.min_capacity, "use_residual": section.use_residual,
        "noisy_gate_policy": section.noisy_gate_policy, "drop_tokens": section.drop_tokens,
        "use_rts": section.use_rts, "bias_update_rate": section.bias_update_rate,
    }


def model_kwargs(section: MoEConfig) -> dict[str, Any]:
    """The model-level MoE settings: the aux-loss weight and which blocks are MoE (every n-th)."""
    return {"aux_loss_coef": section.aux_loss_coef, "moe_every": section.moe_every}
