"""The `moe` section of the engine config (deepfleet's own; DeepSpeed configures MoE in code only):
the Mixture-of-Experts shape a job's model factory builds and the expert-parallel degree the engine
places it on. Read by `engine/parallel.py` (`DEGREE_KEYS["ep"] = "moe.ep_size"`), by `engine.initialize`
(the model's `MoE(ep_size=...)` layers must agree) and by model factories of the managed loop
(`worker/train.py`, `examples/gpt/moe_model.py`). Field names and defaults are the arguments of
DeepSpeed's `MoE` layer. Torch-free.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from deepfleet.engine.config_base import Bool, ConfigSection, Float, Int


class MoEConfig(ConfigSection):
    """Mixture-of-Experts layers and expert parallelism."""

    num_experts: Int = Field(1, ge=1)
    """Experts per MoE layer."""
    ep_size: Int = Field(1, ge=1)
    """Expert-parallel degree: ranks an MoE layer's experts are spread over (divides num_experts and the
    data-parallel size)."""
    k: Int = Field(1, ge=1)
    """Experts each token is routed to (top-k)."""
    capacity_factor: Float = Field(1.0, gt=0)
    """Expert capacity while training, as a multiple of tokens * k / num_experts."""
    eval_capacity_factor: Float = Field(1.0, gt=0)
    """Expert capacity in eval mode."""
    min_capacity: Int = Field(4, ge=0)
    """Lower bound of every expert's capacity."""
    drop_tokens: Bool = True
    """Drop assignments beyond capacity; false = dropless routing."""
    use_rts: Bool = True
    """Random token selection when a top-1 expert is over capacity."""
    noisy_gate_policy: Literal["Jitter", "RSample", "None"] | None = None
    """Noise in the gate while training."""
    use_residual: Bool = False
    """Residual MoE: a dense MLP branch beside the experts, mixed by a learned coefficient."""
    aux_loss_coef: Float = Field(0.01, ge=0)
    """Weight of the load-balancing loss added to the model loss (model factories use it)."""
    bias_update_rate: Float = Field(0.0, ge=0)
    """Auxiliary-loss-free balancing: per-step bias update speed (0 = off)."""
    moe_every: Int = Field(1, ge=1)
    """Model factories make every this-many-th block's MLP an MoE layer."""

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"ep_size: {self.ep_size} does not divide num_experts {self.num_experts}; "
                "each expert-parallel rank holds num_experts / ep_size experts, so use a divisor"
            )
        if self.k > self.num_experts:
            raise ValueError(f"k: {self.k} exceeds num_experts {self.num_experts}; use k <= num_experts")
        return self
