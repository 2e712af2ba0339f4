"""DeepSpeed's optimizer classes with their constructor signatures (`deepspeed.ops.adam.FusedAdam`,
`DeepSpeedCPUAdam`, `deepspeed.ops.lamb.FusedLamb`, `deepspeed.ops.lion.FusedLion`), for scripts that
build the optimizer themselves and hand it to `initialize(optimizer=...)`.

They are the engine's own optimizers (`deepfleet.engine.optim`) under DeepSpeed's argument names: the
update of `Adam` (fused AdamW kernel when bias-corrected and decoupled, a foreach step otherwise),
`Lamb` and `Lion`. `DeepSpeedCPUAdam` is the same Adam: on the CPU its decoupled, bias-corrected case
runs torch's fused CPU AdamW kernel, measured faster than DeepSpeed's CPU-Adam extension on this
project's machines. Re-exported at `deepfleet.engine.ops.adam`, `.ops.lamb`, `.ops.lion`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deepfleet.engine.optim import Adam, Lamb, Lion

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "FusedLamb", "FusedLion"]


class _SetGradNone:
    """DeepSpeed's fused optimizers' `set_grad_none`: what `zero_grad()` does by default."""

    set_grad_none = True

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


class FusedAdam(_SetGradNone, Adam):
    """`deepspeed.ops.adam.FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay,
    amsgrad, set_grad_none)`; like DeepSpeed's, it refuses AMSGrad."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant; use torch.optim.Adam(amsgrad=True)")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, adam_w_mode=adam_w_mode)
        self.set_grad_none = set_grad_none


class DeepSpeedCPUAdam(Adam):
    """`deepspeed.ops.adam.DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay,
    amsgrad, adamw_mode, fp32_optimizer_states)`: Adam over host-resident parameters."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        if amsgrad:
            raise RuntimeError("DeepSpeedCPUAdam does not support the AMSGrad variant; use torch.optim.Adam")
        if not fp32_optimizer_states:
            raise ValueError("fp32_optimizer_states: only True is supported; the moments are kept in fp32")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, adam_w_mode=adamw_mode)


class FusedLamb(_SetGradNone, Lamb):
    """`deepspeed.ops.lamb.FusedLamb(params, lr, bias_correction, betas, eps, eps_inside_sqrt,
    weight_decay, max_grad_norm, max_coeff, min_coeff, amsgrad)`. Clip gradients with the engine's
    `gradient_clipping` (DeepSpeed's `max_grad_norm` here is per optimizer; only 0 is accepted)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False) -> None:
        if amsgrad:
            raise RuntimeError("FusedLamb does not support the AMSGrad variant")
        if max_grad_norm:
            raise ValueError("max_grad_norm: use the config's top-level gradient_clipping instead (or pass 0)")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                         max_coeff=max_coeff, min_coeff=min_coeff)


class FusedLion(_SetGradNone, Lion):
    """`deepspeed.ops.lion.FusedLion(params, lr, betas, weight_decay, set_grad_none)`."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, set_grad_none: bool = True) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none
