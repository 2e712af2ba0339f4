"""1-bit Adam and 0/1 Adam: Adam whose communication is 1-bit compressed after a warm-up.

Built by `deepfleet.engine.optim.build_optimizer` for `"type": "OneBitAdam"` / `"ZeroOneAdam"` (ZeRO
stage 0). Parameter names and meanings are DeepSpeed's; the code is ours (see `engine/onebit/base.py`
for the seam with the strategy and `allreduce.py` for the compressed all-reduce).

1-bit Adam (Tang et al., 2021). Steps 1..freeze_step are Adam on fp32-averaged gradients. After that the
variance is frozen and the gradients stay local: each rank folds its own gradient into the momentum,
m = b1 m + (1 - b1) g_local, and the momentum is replaced by its compressed average over the ranks,
so only sign bits and scales cross the wire.

0/1 Adam (Lu et al., 2022). Until var_freeze_step the variance is updated only on steps that are
multiples of an interval that doubles after every var_update_scaler updates (those steps average the
gradients in fp32); on the other steps the gradient itself is compressed-averaged and only the momentum
moves. After var_freeze_step the variance is frozen and ranks take local steps: every
local_step_interval steps (doubling every local_step_scaler steps, at most local_step_clipper) the
parameter change accumulated since the last sync is compressed-averaged, the local changes are
replaced by that average and the momentum is re-derived from it, so parameters agree on every rank
after each sync.

Update, both: u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w; w -= lr * u, with m_hat, v_hat the
bias-corrected moments when `bias_correction` (DeepSpeed accepts the key and ignores it; here it means
what it says; the variance's correction stops with its updates). `eps_inside_sqrt` puts eps under the root.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from deepfleet.engine.onebit.base import OneBitOptimizer, scalar
from deepfleet.engine.optim import params_with_grad


def _denominator(exp_avg_sq: torch.Tensor, *, correction: float, eps: float, inside: bool) -> torch.Tensor:
    v_hat = exp_avg_sq / correction
    return (v_hat + eps).sqrt() if inside else v_hat.sqrt().add_(eps)


class OneBitAdam(OneBitOptimizer):
    """1-bit Adam (see the module docstring). Defaults are DeepSpeed's."""

    def __init__(self, params: Iterable[Any], *, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt))
        self.freeze_step = freeze_step

    def _reduce_at(self, step: int) -> bool:
        return step <= self.freeze_step

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            params = params_with_grad(group)
            if not params:
                continue
            beta1, beta2 = group["betas"]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = scalar(0)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
            step = int(self.state[params[0]]["step"])
            exp_avgs = [self.state[p]["exp_avg"] for p in params]
            grads = [p.grad for p in params]
            torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)                 # m = b1 m + (1 - b1) g
            if self._reduce_at(step):
                exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
                torch._foreach_mul_(exp_avg_sqs, beta2)                         # v = b2 v + (1 - b2) g^2
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
            else:  # g was local: m holds this rank's momentum; replace it by the compressed average
                for m, mean in zip(exp_avgs, self._compressed_mean(index, exp_avgs), strict=True):
                    m.copy_(mean)
            var_steps = min(step, self.freeze_step)
            for p in params:
                _adam_update(p, self.state[p], group, step=step, var_steps=var_steps)
        self.steps += 1
        return loss


def _adam_update(p: torch.Tensor, state: dict, group: dict, *, step: int, var_steps: int) -> torch.Tensor:
    """w -= lr * u (see the module docstring); returns lr * u, the change subtracted."""
    beta1, beta2 = group["betas"]
    c1 = 1.0 - beta1**step if group["bias_correction"] else 1.0
    c2 = 1.0 - beta2**var_steps if group["bias_correction"] else 1.0
    denom = _denominator(state["exp_avg_sq"], correction=c2, eps=group["eps"], inside=group["eps_inside_sqrt"])
    update = state["exp_avg"] / denom / c1
    if group["weight_decay"]:
        update.add_(p, alpha=group["weight_decay"])
    update.mul_(group["lr"])
    p.sub_(update)
    return update


class ZeroOneAdam(OneBitOptimizer):
    """0/1 Adam (see the module docstring). Defaults are DeepSpeed's."""

    def __init__(self, params: Iterable[Any], *, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt))
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper

    def _schedule(self) -> dict:
        """The interval counters, kept as 0-dim tensors in the first parameter's state (checkpointed
        with it; every parameter steps together)."""
        state = self.state[self.param_groups[0]["params"][0]]
        for key, start in (("var_interval", 1), ("var_counter", 0), ("var_steps", 0),
                           ("local_step_interval", 1), ("local_step_counter", 0)):
            state.setdefault(key, scalar(start))
        return state

    def _reduce_at(self, step: int) -> bool:
        if step > self.var_freeze_step:
            return False
        state = self.state.get(self.param_groups[0]["params"][0])  # .get: asking creates no state
        interval = int(state["var_interval"]) if state and "var_interval" in state else 1
        return step % interval == 0

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        schedule = self._schedule()
        for index, group in enumerate(self.param_groups):
            params = params_with_grad(group)
            if params:
                self._step_group(index, group, params, schedule)
        step = self._next_step() - 1
        if step <= self.var_freeze_step:
            if step % int(schedule["var_interval"]) == 0:
                schedule["var_counter"] += 1
                if int(schedule["var_counter"]) == self.var_update_scaler:
                    schedule["var_counter"].zero_()
                    schedule["var_interval"] *= 2
            if step == self.var_freeze_step:  # local steps start from clean errors
                self.reset_error_feedback()
        else:
            schedule["local_step_counter"] += 1
            if int(schedule["local_step_counter"]) == self.local_step_scaler:
                schedule["local_step_counter"].zero_()
                schedule["local_step_interval"].copy_(
                    min(self.local_step_clipper, 2 * int(schedule["local_step_interval"])))
        self.steps += 1
        return loss

    def _step_group(self, index: int, group: dict, params: list[torch.Tensor], schedule: dict) -> None:
        beta1, beta2 = group["betas"]
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state.setdefault("step", scalar(0))
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
                state["momentum_accumulator"] = torch.zeros_like(p)
                state["lrs"] = scalar(0)
            state["step"] += 1
        step = int(self.state[params[0]]["step"])
        exp_avgs = [self.state[p]["exp_avg"] for p in params]
        grads = [p.grad for p in params]
        if step <= self.var_freeze_step:
            if self._reduce_at(step):  # fp32-averaged gradients: both moments move
                exp_avg_sqs = [self.state[p]["exp_avg_sq"] for p in params]
                torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
                torch._foreach_mul_(exp_avg_sqs, beta2)
                torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
                if index == 0:
                    schedule["var_steps"] += 1
            else:  # local gradients: average them compressed; only the momentum moves
                torch._foreach_lerp_(exp_avgs, self._compressed_mean(index, grads), 1.0 - beta1)
            for p in params:
                _adam_update(p, self.state[p], group, step=step, var_steps=int(schedule["var_steps"]))
            return
        # local steps on local gradients, accumulating the change; a sync every local_step_interval steps
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        c1 = 1.0 - beta1**step if group["bias_correction"] else 1.0
        for p in params:
            state = self.state[p]
            state["momentum_accumulator"].sub_(
                _adam_update(p, state, group, step=step, var_steps=int(schedule["var_steps"])))
            state["lrs"] += group["lr"] / c1
        if step % int(schedule["local_step_interval"]):
            return
        beta2_steps = int(schedule["var_steps"])
        c2 = 1.0 - beta2**beta2_steps if group["bias_correction"] else 1.0
        denoms = [_denominator(self.state[p]["exp_avg_sq"], correction=c2, eps=group["eps"],
                               inside=group["eps_inside_sqrt"]) for p in params]
        accs = [self.state[p]["momentum_accumulator"] for p in params]
        torch._foreach_sub_(params, accs)                                       # undo the local changes
        scaled = torch._foreach_mul(accs, denoms)                               # back to momentum units
        for p, mean, denom in zip(params, self._compressed_mean(index, scaled), denoms, strict=True):
            state = self.state[p]
            state["exp_avg"].copy_(mean).div_(-float(state["lrs"]))              # m = -sum(lr u) denom / sum(lr)
            p.add_(mean / denom)                                                 # the averaged change
            state["momentum_accumulator"].zero_()
            state["lrs"].zero_()
