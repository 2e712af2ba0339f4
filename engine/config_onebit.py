"""The `optimizer` variants `OneBitAdam`, `ZeroOneAdam` and `OneBitLamb`: DeepSpeed's parameter names and
defaults (its `runtime/fp16/onebit/` signatures), our meanings where DeepSpeed's were none.

Part of the `optimizer` union in `config_optim.py`; built by `deepfleet.engine.optim.build_optimizer`
into the optimizers of `engine/onebit/`. Torch-free.

- `cuda_aware` and `comm_backend_name` choose DeepSpeed's MPI/NCCL/HCCL transport; here every collective
  goes through `engine/comm.py` on the data-parallel group's backend, so any of DeepSpeed's values is
  accepted and changes nothing.
- `amsgrad: true` is refused (DeepSpeed refuses it too); `max_grad_norm` becomes the top-level
  `gradient_clipping` (config.py), as for every optimizer.
- These optimizers reduce the gradients themselves, which the ZeRO stage-0 strategy supports; at stages
  1-3 (DeepSpeed refuses them there too) the `communication` section compresses the gradient
  reduction instead (`one_bit_stage_problem`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from deepfleet.engine.config_base import Betas, Bool, ConfigSection, Float, Int

ONEBIT_TYPES = ("OneBitAdam", "ZeroOneAdam", "OneBitLamb")
CommBackend = Literal["nccl", "mpi", "hccl", "compressed"]


class _OneBitCommon(ConfigSection):
    lr: Float = Field(1e-3, ge=0.0)
    """Learning rate."""
    bias_correction: Bool = True
    """Bias-correct the moment estimates (Adam variants; LAMB's trust ratio cancels it)."""
    betas: Betas = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: Float = Field(1e-8, ge=0.0)
    """Added to the denominator for numerical stability."""
    eps_inside_sqrt: Bool = False
    """Add eps inside the square root instead of after it."""
    weight_decay: Float = Field(0.0, ge=0.0)
    """Decoupled weight decay, added to the update."""
    amsgrad: Bool = False
    """AMSGrad is not supported by the 1-bit optimizers (only false)."""
    cuda_aware: Bool = False
    """DeepSpeed's CUDA-aware MPI switch; accepted, no effect (collectives go through engine/comm.py)."""
    comm_backend_name: CommBackend = "nccl"
    """DeepSpeed's transport for the compressed all-reduce; accepted, no effect (the group's backend is used)."""

    @model_validator(mode="after")
    def _no_amsgrad(self) -> _OneBitCommon:
        if self.amsgrad:
            raise ValueError("amsgrad: the 1-bit optimizers do not support AMSGrad; drop amsgrad or set it false")
        return self


class OneBitAdamParams(_OneBitCommon):
    """Parameters of DeepSpeed's `OneBitAdam`."""

    freeze_step: Int = Field(100000, ge=0)
    """Steps of full-precision Adam before the variance freezes and the momentum is 1-bit compressed."""


class ZeroOneAdamParams(_OneBitCommon):
    """Parameters of DeepSpeed's `ZeroOneAdam`."""

    var_freeze_step: Int = Field(100000, ge=0)
    """Steps after which the variance freezes and local steps start."""
    var_update_scaler: Int = Field(16, gt=0)
    """Variance updates between doublings of the variance-update interval."""
    local_step_scaler: Int = Field(32678, gt=0)
    """Steps after the variance freeze between doublings of the local-step interval."""
    local_step_clipper: Int = Field(16, gt=0)
    """Largest local-step interval (steps between synchronizations)."""


class OneBitLambParams(_OneBitCommon):
    """Parameters of DeepSpeed's `OneBitLamb`."""

    freeze_step: Int = Field(100000, ge=0)
    """Steps of full-precision LAMB before the momentum is 1-bit compressed and the trust ratios freeze."""
    max_coeff: Float = Field(10.0, gt=0.0)
    """Upper clamp of the warm-up trust ratio."""
    min_coeff: Float = Field(0.01, ge=0.0)
    """Lower clamp of the warm-up trust ratio."""
    coeff_beta: Float = Field(0.9, ge=0.0, lt=1.0)
    """Decay of the running average of the warm-up trust ratios (the frozen coefficient)."""
    factor_max: Float = Field(4.0, gt=0.0)
    """Upper clamp of the frozen coefficient's correction factor."""
    factor_min: Float = Field(0.5, ge=0.0)
    """Lower clamp of the correction factor."""
    factor_threshold: Float = Field(0.1, ge=0.0)
    """Largest relative change of the correction factor from one step to the next."""

    @model_validator(mode="after")
    def _bounds(self) -> OneBitLambParams:
        problems = []
        if self.min_coeff > self.max_coeff:
            problems.append(f"min_coeff: {self.min_coeff} > max_coeff {self.max_coeff}; make min_coeff <= max_coeff")
        if self.factor_min > self.factor_max:
            problems.append(f"factor_min: {self.factor_min} > factor_max {self.factor_max}; swap them")
        if problems:
            raise ValueError("\n".join(problems))
        return self


class OneBitAdamConfig(ConfigSection):
    """`"type": "OneBitAdam"`: 1-bit Adam."""

    type: Literal["OneBitAdam"] = "OneBitAdam"
    """Optimizer name (matched case-insensitively)."""
    params: OneBitAdamParams = Field(default_factory=OneBitAdamParams)
    """Optimizer hyper-parameters."""


class ZeroOneAdamConfig(ConfigSection):
    """`"type": "ZeroOneAdam"`: 0/1 Adam."""

    type: Literal["ZeroOneAdam"] = "ZeroOneAdam"
    """Optimizer name (matched case-insensitively)."""
    params: ZeroOneAdamParams = Field(default_factory=ZeroOneAdamParams)
    """Optimizer hyper-parameters."""


class OneBitLambConfig(ConfigSection):
    """`"type": "OneBitLamb"`: 1-bit LAMB."""

    type: Literal["OneBitLamb"] = "OneBitLamb"
    """Optimizer name (matched case-insensitively)."""
    params: OneBitLambParams = Field(default_factory=OneBitLambParams)
    """Optimizer hyper-parameters."""


def one_bit_stage_problem(optimizer: object, stage: int) -> list[str]:
    """The error line for a 1-bit optimizer at a ZeRO stage other than 0 (empty when it fits)."""
    kind = getattr(optimizer, "type", None)
    if kind in ONEBIT_TYPES and stage != 0:
        return [
            f"optimizer.type: {kind} reduces gradients itself and needs zero_optimization.stage 0 (got {stage}); "
            "use stage 0, or keep the stage and compress its gradient reduction with the \"communication\" section"
        ]
    return []
