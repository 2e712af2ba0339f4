"""1-bit LAMB (Li et al., 2022): LAMB whose momentum is 1-bit compressed after a warm-up, with the
layer-wise trust ratios frozen from the warm-up and corrected by a bounded factor.

Built by `deepfleet.engine.optim.build_optimizer` for `"type": "OneBitLamb"` (ZeRO stage 0); DeepSpeed's
parameter names and meanings, our code (`engine/onebit/base.py`: the seam with the strategy).

Warm-up (steps 1..freeze_step, fp32-averaged gradients): LAMB, u = m / (sqrt(v) + eps) + weight_decay * w,
coefficient r = clamp(||w|| / ||u||, min_coeff, max_coeff), w -= lr * r * u; an exponential average of r
(coeff_beta) becomes the frozen coefficient; at freeze_step the variance is copied into a "fresh" one.
Compression (later steps, local gradients):
  - once, each tensor's momentum gets a scaling coefficient (the mean over tensors of ||m|| / sqrt(numel),
    over this tensor's), so tensors of very different magnitudes compress alike;
  - m = b1 m + (1 - b1) g_local, scaled, compressed-averaged, unscaled;
  - the fresh variance follows the gradient reconstructed from the momentum, (m - b1 m_prev) / (1 - b1),
    while the frozen variance stays in the update;
  - factor = max(denominator_frozen / denominator_fresh) (mixed with 1 by the weight-decay share of the
    update), clamped to [factor_min, factor_max] and to within factor_threshold of the last factor;
  - w -= lr * (frozen coefficient * factor) * u.
LAMB's trust ratio cancels a bias correction of the moments (a per-step scalar), so `bias_correction`
is accepted and, as in DeepSpeed, changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from deepfleet.engine.onebit.base import OneBitOptimizer, scalar
from deepfleet.engine.optim import params_with_grad


class OneBitLamb(OneBitOptimizer):
    """1-bit LAMB (see the module docstring). Defaults are DeepSpeed's."""

    def __init__(self, params: Iterable[Any], *, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt,
                                      max_coeff=max_coeff, min_coeff=min_coeff))
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.lamb_coeffs: list[float] = []  # the last step's coefficient per tensor (DeepSpeed's get_lamb_coeffs)

    def _reduce_at(self, step: int) -> bool:
        return step <= self.freeze_step

    def get_lamb_coeffs(self) -> list[float]:
        return list(self.lamb_coeffs)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lamb_coeffs = []
        groups = [(i, g, params_with_grad(g)) for i, g in enumerate(self.param_groups)]
        for _, _, params in groups:
            for p in params:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["step"] = scalar(0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                    state["exp_avg_sq_fresh"] = torch.zeros_like(p)
                    state["lamb_coeff_freeze"] = scalar(0)
                    state["last_factor"] = scalar(1)
                    state["scaling_coeff"] = scalar(0)  # 0: not set yet (set when compression starts)
                state["step"] += 1
        step = self._next_step() - 1
        if self._reduce_at(step):
            for _, group, params in groups:
                self._warmup(group, params, step=step)
        else:
            self._set_scaling_coeffs([p for _, _, params in groups for p in params])
            for index, group, params in groups:
                if params:
                    self._compressed(index, group, params)
        self.steps += 1
        return loss

    def _direction(self, p: torch.Tensor, state: dict, group: dict, variance: torch.Tensor) -> tuple:
        eps = group["eps"]
        denom = (variance + eps).sqrt() if group["eps_inside_sqrt"] else variance.sqrt().add_(eps)
        prelim = state["exp_avg"] / denom
        update = prelim + group["weight_decay"] * p if group["weight_decay"] else prelim
        return denom, prelim, update

    def _warmup(self, group: dict, params: list[torch.Tensor], *, step: int) -> None:
        beta1, beta2 = group["betas"]
        for p in params:
            state, g = self.state[p], p.grad
            state["exp_avg"].lerp_(g, 1.0 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            if step == self.freeze_step:
                state["exp_avg_sq_fresh"].copy_(state["exp_avg_sq"])
            _, _, update = self._direction(p, state, group, state["exp_avg_sq"])
            w_norm, u_norm = float(p.norm()), float(update.norm())
            coeff = 1.0
            if w_norm > 0 and u_norm > 0:
                coeff = min(max(w_norm / u_norm, group["min_coeff"]), group["max_coeff"])
            if coeff != 1.0:
                state["lamb_coeff_freeze"].mul_(self.coeff_beta).add_((1.0 - self.coeff_beta) * coeff)
            self.lamb_coeffs.append(coeff)
            p.add_(update, alpha=-group["lr"] * coeff)

    def _set_scaling_coeffs(self, params: list[torch.Tensor]) -> None:
        if not params or float(self.state[params[0]]["scaling_coeff"]) != 0:
            return
        scales = [float(self.state[p]["exp_avg"].norm()) / math.sqrt(p.numel()) for p in params]
        united = sum(scales) / len(scales)
        for p, scale in zip(params, scales, strict=True):
            self.state[p]["scaling_coeff"].fill_(united / scale if scale > 0 else 1.0)

    def _compressed(self, index: int, group: dict, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        last = [self.state[p]["exp_avg"].clone() for p in params]
        scaled = []
        for p in params:
            state = self.state[p]
            state["exp_avg"].lerp_(p.grad, 1.0 - beta1).mul_(float(state["scaling_coeff"]))
            scaled.append(state["exp_avg"])
        for p, mean in zip(params, self._compressed_mean(index, scaled), strict=True):
            state = self.state[p]
            state["exp_avg"].copy_(mean).div_(float(state["scaling_coeff"]))
        for p, m_prev in zip(params, last, strict=True):
            state = self.state[p]
            rebuilt = (state["exp_avg"] - beta1 * m_prev) / (1.0 - beta1)               # the averaged gradient
            state["exp_avg_sq_fresh"].mul_(beta2).addcmul_(rebuilt, rebuilt, value=1.0 - beta2)
            denom, prelim, update = self._direction(p, state, group, state["exp_avg_sq"])
            fresh = state["exp_avg_sq_fresh"]
            fresh_denom = (fresh + group["eps"]).sqrt() if group["eps_inside_sqrt"] else fresh.sqrt() + group["eps"]
            factor = float((denom / fresh_denom).max())
            if group["weight_decay"]:
                u_norm = float(update.norm())
                share = min(1.0, float(prelim.norm()) / u_norm) if u_norm > 0 else 1.0
                factor = factor * share + (1.0 - share)
            factor = min(max(factor, self.factor_min), self.factor_max)
            last_factor = float(state["last_factor"])
            factor = min(max(factor, last_factor * (1.0 - self.factor_threshold)),
                         last_factor * (1.0 + self.factor_threshold))
            state["last_factor"].fill_(factor)
            coeff = float(state["lamb_coeff_freeze"]) * factor
            self.lamb_coeffs.append(coeff)
            p.add_(update, alpha=-group["lr"] * coeff)
