"""The `optimizer` and `scheduler` sections of the engine config.

Each optimizer and each LR schedule is one variant of a discriminated union on `type`, so a
config carries only the parameters its variant understands (an `Adam` section with `momentum` is
an unknown key, named). Parameter names and defaults follow DeepSpeed's code: its `Adam`/`AdamW`
(FusedAdam; `torch_adam` selects torch's classes), `Lamb` (FusedLamb), `Lion` (FusedLion), torch's
`SGD`/`Adagrad`, the 1-bit optimizers (`config_onebit.py`), and its five schedules in `runtime/lr_schedules.py`. Read by
`deepfleet.engine.optim.build_optimizer` and `deepfleet.engine.lr_schedules.build_lr_scheduler`.
Torch-free.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from deepfleet.engine.config_base import Betas, Bool, ConfigSection, Float, Int, PerGroupRate
from deepfleet.engine.config_onebit import ONEBIT_TYPES, OneBitAdamConfig, OneBitLambConfig, ZeroOneAdamConfig

# DeepSpeed matches optimizer types case-insensitively; these are the canonical spellings.
OPTIMIZER_TYPES = ("Adam", "AdamW", "SGD", "Adagrad", "Lamb", "Lion", *ONEBIT_TYPES)
# Optimizers DeepSpeed knows (its own, or any torch.optim class by name) that this engine lacks.
OPTIMIZERS_NOT_SUPPORTED = (
    "MuAdam", "MuAdamW", "MuSGD", "Muon",
    "Adadelta", "Adamax", "ASGD", "LBFGS", "NAdam", "RAdam", "RMSprop", "Rprop", "SparseAdam", "Adafactor",
)
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


# --------------------------------------------------------------------------- optimizers


class AdamParams(ConfigSection):
    """Parameters of DeepSpeed's `Adam`/`AdamW` (its FusedAdam signature plus the two selectors)."""

    lr: Float = Field(1e-3, ge=0.0)
    """Learning rate (the base value the LR schedule scales)."""
    betas: Betas = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: Float = Field(1e-8, ge=0.0)
    """Added to the denominator for numerical stability."""
    weight_decay: Float | None = Field(None, ge=0.0)
    """Weight decay. Unset resolves to DeepSpeed's effective default: 0.01 for torch's AdamW
    (`torch_adam` with decoupled decay), else 0.0 (FusedAdam)."""
    bias_correction: Bool = True
    """Bias-correct the moment estimates (`false`: DeepSpeed's FusedAdam without correction, stepped by
    `deepfleet.engine.optim.Adam`)."""
    amsgrad: Bool = False
    """Use the AMSGrad variant (keeps the maximum of past squared-gradient averages)."""
    adam_w_mode: Bool = True
    """Decoupled weight decay (AdamW). DeepSpeed's `Adam` defaults to it; `AdamW` always uses it."""
    torch_adam: Bool = False
    """Use torch's Adam/AdamW classes (their `foreach` path) instead of the fused AdamW kernel; the same
    update."""


class SGDParams(ConfigSection):
    """Parameters of torch's `SGD`."""

    lr: Float = Field(1e-3, ge=0.0)
    """Learning rate."""
    momentum: Float = Field(0.0, ge=0.0)
    """Momentum factor (0 = plain SGD)."""
    dampening: Float = Field(0.0, ge=0.0)
    """Dampening for momentum."""
    weight_decay: Float = Field(0.0, ge=0.0)
    """L2 penalty added to the gradient."""
    nesterov: Bool = False
    """Nesterov momentum (needs momentum > 0 and dampening 0)."""

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> SGDParams:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("nesterov: needs momentum > 0 and dampening 0; set momentum or drop nesterov")
        return self


class AdagradParams(ConfigSection):
    """Parameters of torch's `Adagrad`."""

    lr: Float = Field(1e-2, ge=0.0)
    """Learning rate."""
    lr_decay: Float = Field(0.0, ge=0.0)
    """Learning-rate decay per step."""
    weight_decay: Float = Field(0.0, ge=0.0)
    """L2 penalty added to the gradient."""
    initial_accumulator_value: Float = Field(0.0, ge=0.0)
    """Starting value of the squared-gradient sum."""
    eps: Float = Field(1e-10, ge=0.0)
    """Added to the denominator for numerical stability."""


class LambParams(ConfigSection):
    """Parameters of DeepSpeed's `Lamb` (layer-wise adaptive Adam; FusedLamb's signature)."""

    lr: Float = Field(1e-3, ge=0.0)
    """Learning rate."""
    betas: Betas = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: Float = Field(1e-8, ge=0.0)
    """Added to the denominator for numerical stability."""
    eps_inside_sqrt: Bool = False
    """Add eps inside the square root (sqrt(v + eps)) instead of after it."""
    weight_decay: Float = Field(0.0, ge=0.0)
    """Decoupled weight decay, added to the Adam update before the trust ratio."""
    bias_correction: Bool = True
    """Bias-correct the moment estimates."""
    max_coeff: Float = Field(10.0, gt=0.0)
    """Upper clamp of the per-tensor trust ratio ||w|| / ||update||."""
    min_coeff: Float = Field(0.01, ge=0.0)
    """Lower clamp of the per-tensor trust ratio."""

    @model_validator(mode="after")
    def _coeff_order(self) -> LambParams:
        if self.min_coeff > self.max_coeff:
            raise ValueError(
                f"min_coeff: {self.min_coeff} > max_coeff {self.max_coeff}; make min_coeff <= max_coeff"
            )
        return self


class LionParams(ConfigSection):
    """Parameters of DeepSpeed's `Lion` (sign of an interpolated momentum; FusedLion's signature)."""

    lr: Float = Field(1e-3, ge=0.0)
    """Learning rate."""
    betas: Betas = (0.9, 0.999)
    """beta1 interpolates the update direction, beta2 is the momentum decay."""
    weight_decay: Float = Field(0.0, ge=0.0)
    """Decoupled weight decay (scaled by lr)."""


class AdamConfig(ConfigSection):
    """`"type": "Adam"`: Adam; decoupled weight decay unless `adam_w_mode` is false."""

    type: Literal["Adam"] = "Adam"
    """Optimizer name (matched case-insensitively)."""
    params: AdamParams = Field(default_factory=AdamParams)
    """Optimizer hyper-parameters."""

    @model_validator(mode="after")
    def _resolve_weight_decay(self) -> AdamConfig:
        _resolve_adam_weight_decay(self.params, decoupled=self.params.adam_w_mode)
        return self


class AdamWConfig(ConfigSection):
    """`"type": "AdamW"`: Adam with decoupled weight decay."""

    type: Literal["AdamW"] = "AdamW"
    """Optimizer name (matched case-insensitively)."""
    params: AdamParams = Field(default_factory=AdamParams)
    """Optimizer hyper-parameters."""

    @model_validator(mode="after")
    def _always_decoupled(self) -> AdamWConfig:
        if not self.params.adam_w_mode:
            raise ValueError(
                "params.adam_w_mode: false contradicts type AdamW (always decoupled weight decay); "
                'use "type": "Adam" for L2-coupled decay or drop adam_w_mode'
            )
        _resolve_adam_weight_decay(self.params, decoupled=True)
        return self


def _resolve_adam_weight_decay(params: AdamParams, *, decoupled: bool) -> None:
    if params.weight_decay is None:
        params.weight_decay = 0.01 if (params.torch_adam and decoupled) else 0.0
    if not params.bias_correction and params.amsgrad:
        raise ValueError("params.bias_correction: false with amsgrad: true is not supported; drop one of them")


class SGDConfig(ConfigSection):
    """`"type": "SGD"`: torch's stochastic gradient descent."""

    type: Literal["SGD"] = "SGD"
    """Optimizer name (matched case-insensitively)."""
    params: SGDParams = Field(default_factory=SGDParams)
    """Optimizer hyper-parameters."""


class AdagradConfig(ConfigSection):
    """`"type": "Adagrad"`: torch's Adagrad."""

    type: Literal["Adagrad"] = "Adagrad"
    """Optimizer name (matched case-insensitively)."""
    params: AdagradParams = Field(default_factory=AdagradParams)
    """Optimizer hyper-parameters."""


class LambConfig(ConfigSection):
    """`"type": "Lamb"`: layer-wise adaptive large-batch optimizer."""

    type: Literal["Lamb"] = "Lamb"
    """Optimizer name (matched case-insensitively)."""
    params: LambParams = Field(default_factory=LambParams)
    """Optimizer hyper-parameters."""


class LionConfig(ConfigSection):
    """`"type": "Lion"`: evolved sign momentum."""

    type: Literal["Lion"] = "Lion"
    """Optimizer name (matched case-insensitively)."""
    params: LionParams = Field(default_factory=LionParams)
    """Optimizer hyper-parameters."""


OptimizerConfig = Annotated[
    AdamConfig | AdamWConfig | SGDConfig | AdagradConfig | LambConfig | LionConfig
    | OneBitAdamConfig | ZeroOneAdamConfig | OneBitLambConfig,
    Field(discriminator="type"),
]


# --------------------------------------------------------------------------- LR schedules


class _Warmup(ConfigSection):
    warmup_num_steps: Int = Field(1000, gt=0)
    """Optimizer steps of warmup (values below 2 act as 2, as in DeepSpeed)."""
    warmup_type: Literal["log", "linear"] = "log"
    """Shape of the warmup curve: `log` rises as log(step + 1) / log(warmup_num_steps), `linear` as
    step / warmup_num_steps."""
    last_batch_iteration: Int = Field(-1, ge=-1)
    """Index of the last step already taken (-1 starts the schedule from the beginning)."""


class WarmupLRParams(_Warmup):
    """Parameters of `WarmupLR`: rise from warmup_min_lr to warmup_max_lr, then hold."""

    warmup_min_lr: PerGroupRate = 0.0
    """Learning rate at step 0 (a number, or one per param group)."""
    warmup_max_lr: PerGroupRate | None = None
    """Learning rate at the end of warmup (a number, or one per param group); unset uses each group's lr."""


class WarmupDecayLRParams(WarmupLRParams):
    """Parameters of `WarmupDecayLR`: WarmupLR, then linear decay to 0 at total_num_steps."""

    total_num_steps: Int = Field(gt=0)
    """Optimizer steps of the whole run; the rate reaches 0 there (required)."""

    @model_validator(mode="after")
    def _warmup_fits(self) -> WarmupDecayLRParams:
        _check_warmup_fits(self.warmup_num_steps, self.total_num_steps)
        return self


class WarmupCosineLRParams(_Warmup):
    """Parameters of `WarmupCosineLR`: ratio warmup, then cosine decay; rates are ratios of the optimizer's lr."""

    total_num_steps: Int = Field(gt=0)
    """Optimizer steps of the whole run; the cosine reaches cos_min_ratio there (required)."""
    warmup_min_ratio: Float = Field(0.0, ge=0.0, le=1.0)
    """Ratio of the optimizer's lr at step 0."""
    cos_min_ratio: Float = Field(0.0001, ge=0.0, le=1.0)
    """Ratio of the optimizer's lr at the end of the cosine."""

    @model_validator(mode="after")
    def _warmup_fits(self) -> WarmupCosineLRParams:
        _check_warmup_fits(self.warmup_num_steps, self.total_num_steps)
        return self


def _check_warmup_fits(warmup: int, total: int) -> None:
    if total < warmup:
        raise ValueError(
            f"total_num_steps: {total} is less than warmup_num_steps {warmup}; "
            "raise total_num_steps or lower warmup_num_steps"
        )


class OneCycleParams(ConfigSection):
    """Parameters of `OneCycle`: lr up then down (momentum the opposite way), then optional decay."""

    cycle_min_lr: Float = Field(ge=0.0)
    """Learning rate at the start and end of the cycle (required)."""
    cycle_max_lr: Float = Field(ge=0.0)
    """Learning rate at the peak of the cycle (required)."""
    decay_lr_rate: Float = Field(0.0, ge=0.0)
    """After the cycle, lr = cycle_min_lr / (1 + decay_lr_rate * steps_after / decay_step_size)."""
    cycle_first_step_size: Int = Field(2000, gt=0)
    """Steps of the rising half."""
    cycle_second_step_size: Int | None = Field(None, gt=0)
    """Steps of the falling half; unset = cycle_first_step_size."""
    cycle_first_stair_count: Int = Field(0, ge=0)
    """Stairs in the rising half (0 = continuous)."""
    cycle_second_stair_count: Int | None = Field(None, ge=0)
    """Stairs in the falling half; unset = cycle_first_stair_count."""
    decay_step_size: Int = Field(0, ge=0)
    """Interval of the post-cycle decay (0 = hold the cycle's end values)."""
    cycle_momentum: Bool = True
    """Cycle beta1 (or momentum) inversely to the learning rate."""
    cycle_min_mom: Float = Field(0.8, ge=0.0, lt=1.0)
    """Momentum at the peak learning rate."""
    cycle_max_mom: Float = Field(0.9, ge=0.0, lt=1.0)
    """Momentum at the start and end of the cycle."""
    decay_mom_rate: Float = Field(0.0, ge=0.0)
    """After the cycle, momentum = cycle_max_mom * (1 + decay_mom_rate * steps_after / decay_step_size)."""
    last_batch_iteration: Int = Field(-1, ge=-1)
    """Index of the last step already taken (-1 starts the schedule from the beginning)."""

    @model_validator(mode="after")
    def _bounds_in_order(self) -> OneCycleParams:
        problems = []
        if self.cycle_min_lr > self.cycle_max_lr:
            problems.append(f"cycle_min_lr: {self.cycle_min_lr} > cycle_max_lr {self.cycle_max_lr}; swap them")
        if self.cycle_momentum and self.cycle_min_mom > self.cycle_max_mom:
            problems.append(f"cycle_min_mom: {self.cycle_min_mom} > cycle_max_mom {self.cycle_max_mom}; swap them")
        if problems:
            raise ValueError("\n".join(problems))
        return self


class LRRangeTestParams(ConfigSection):
    """Parameters of `LRRangeTest`: lr = min_lr * (1 + step_rate * interval), interval continuous or stepped."""

    lr_range_test_min_lr: PerGroupRate = 1e-3
    """Learning rate at step 0 (a number, or one per param group)."""
    lr_range_test_step_size: Int = Field(2000, gt=0)
    """Steps per unit of interval."""
    lr_range_test_step_rate: Float = Field(1.0, ge=0.0)
    """Growth per unit of interval."""
    lr_range_test_staircase: Bool = False
    """Grow in whole steps of lr_range_test_step_size (floor) instead of continuously."""
    last_batch_iteration: Int = Field(-1, ge=-1)
    """Index of the last step already taken (-1 starts the schedule from the beginning)."""


class WarmupLRConfig(ConfigSection):
    """`"type": "WarmupLR"`."""

    type: Literal["WarmupLR"] = "WarmupLR"
    """Schedule name."""
    params: WarmupLRParams = Field(default_factory=WarmupLRParams)
    """Schedule parameters."""


class WarmupDecayLRConfig(ConfigSection):
    """`"type": "WarmupDecayLR"`."""

    type: Literal["WarmupDecayLR"] = "WarmupDecayLR"
    """Schedule name."""
    params: WarmupDecayLRParams
    """Schedule parameters (total_num_steps is required)."""


class WarmupCosineLRConfig(ConfigSection):
    """`"type": "WarmupCosineLR"`."""

    type: Literal["WarmupCosineLR"] = "WarmupCosineLR"
    """Schedule name."""
    params: WarmupCosineLRParams
    """Schedule parameters (total_num_steps is required)."""


class OneCycleConfig(ConfigSection):
    """`"type": "OneCycle"`."""

    type: Literal["OneCycle"] = "OneCycle"
    """Schedule name."""
    params: OneCycleParams
    """Schedule parameters (cycle_min_lr and cycle_max_lr are required)."""


class LRRangeTestConfig(ConfigSection):
    """`"type": "LRRangeTest"`."""

    type: Literal["LRRangeTest"] = "LRRangeTest"
    """Schedule name."""
    params: LRRangeTestParams = Field(default_factory=LRRangeTestParams)
    """Schedule parameters."""


SchedulerConfig = Annotated[
    WarmupLRConfig | WarmupDecayLRConfig | WarmupCosineLRConfig | OneCycleConfig | LRRangeTestConfig,
    Field(discriminator="type"),
]
