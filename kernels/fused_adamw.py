"""Fused AdamW step over a parameter group, with fp32 master weights, a low-precision model copy and
optional fused gradient unscaling with an overflow check (fp16 loss scaling).

Called by the engine's `FusedAdamW` optimizer (`engine/optim.py`, DeepSpeed's "Adam"/"AdamW"), once per
param group and step count, on the local tensors of that group (DTensor shards are passed as their
local shards), under `torch.no_grad()`. `deepfleet::fused_adamw` is the custom op that dispatches (see
`_dispatch`): to `kernels/_triton/fused_adamw.py` when the Triton path is selected (CUDA tensors);
with `DEEPFLEET_KERNELS=auto` on CPU tensors, to torch's own fused CPU kernel (`aten::_fused_adamw_`,
what `torch.optim.AdamW(fused=True)` runs: measured by `benchmarks/optim_step.py` at 5x the speed of
torch's `foreach` path and 14-26x the reference's); otherwise to the pure-torch function here, which is
the specification (and what `DEEPFLEET_KERNELS=torch` runs).

Why hand-written: `torch.optim.AdamW(fused=True)` keeps params and state in one dtype and has no fp32
master with a bf16/fp16 model copy written in the same pass, which is what mixed-precision ZeRO needs;
and the overflow verdict must come back as a device tensor without a host sync.

Update (the semantics of `torch.optim.AdamW`, decoupled weight decay), per element, in fp32:
  g = grad / grad_scale                              (when a grad_scale is given)
  p = p * (1 - lr * weight_decay)
  m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g**2
  p = p - lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)
  model_param = p (rounded to its dtype)
If any unscaled gradient of the group is inf or nan, nothing is updated and the returned 0-d
`found_inf` is 1.0 (else 0.0). A "flat" group is a list of one tensor per role. The Triton path updates
the whole group in one launch and needs the tensors of each role to share a dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from deepfleet.kernels._dispatch import selected_impl, triton_module, use_triton


def fused_adamw_reference(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    model_params: list[Tensor],
    grad_scale: Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> Tensor:
    """The specification, in place on params/exp_avgs/exp_avg_sqs/model_params; returns found_inf."""
    found_inf = torch.zeros((), dtype=torch.float32, device=params[0].device)
    inv_scale = None if grad_scale is None else 1.0 / grad_scale.to(torch.float32)
    if inv_scale is not None:
        for g in grads:
            if not torch.isfinite(g.float() * inv_scale).all():
                found_inf.fill_(1.0)
                return found_inf
    bias1 = 1 - beta1**step
    bias2_sqrt = math.sqrt(1 - beta2**step)
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        acc = torch.promote_types(p.dtype, torch.float32)
        g32 = g.to(acc) if inv_scale is None else g.to(acc) * inv_scale
        p32 = p.to(acc) * (1 - lr * weight_decay)
        m32 = beta1 * m.to(acc) + (1 - beta1) * g32
        v32 = beta2 * v.to(acc) + (1 - beta2) * g32 * g32
        p32 = p32 - (lr / bias1) * m32 / (v32.sqrt() / bias2_sqrt + eps)
        p.copy_(p32)
        m.copy_(m32)
        v.copy_(v32)
        if model_params:
            model_params[i].copy_(p32)
    return found_inf


def _torch_fused_cpu_applies(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    grad_scale: Tensor | None,
) -> bool:
    """torch's fused CPU kernel applies to CPU tensors whose grads and moments share the param's dtype.
    With a grad_scale the reference runs: its overflow verdict is on the unscaled gradients."""
    if grad_scale is not None:
        return False
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if p.device.type != "cpu" or not (p.dtype == g.dtype == m.dtype == v.dtype) or not p.is_floating_point():
            return False
    return True


def fused_adamw_torch_cpu(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    model_params: list[Tensor],
    grad_scale: Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> Tensor:
    """The reference's update through torch's fused CPU AdamW kernel, one call per param dtype."""
    assert grad_scale is None, "the reference handles grad_scale"
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, p in enumerate(params):
        by_dtype.setdefault(p.dtype, []).append(i)
    for idx in by_dtype.values():
        steps = [torch.tensor(float(step))] * len(idx)  # read-only: the count including this update
        torch._fused_adamw_(
            [params[i] for i in idx], [grads[i] for i in idx], [exp_avgs[i] for i in idx],
            [exp_avg_sqs[i] for i in idx], [], steps, lr=lr, beta1=beta1, beta2=beta2,
            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip
    if model_params:
        torch._foreach_copy_(model_params, params)
    return torch.zeros((), dtype=torch.float32, device=params[0].device)


@torch.library.custom_op(
    "deepfleet::fused_adamw", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "model_params")
)
def fused_adamw_op(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    model_params: list[Tensor],
    grad_scale: Tensor | None,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> Tensor:
    """In-place AdamW step; returns found_inf (0-d fp32). Not differentiable (an optimizer step)."""
    if use_triton(*params, *grads, *exp_avgs, *exp_avg_sqs, *model_params):
        impl = triton_module("fused_adamw").fused_adamw
    elif selected_impl() == "auto" and _torch_fused_cpu_applies(params, grads, exp_avgs, exp_avg_sqs, grad_scale):
        impl = fused_adamw_torch_cpu
    else:
        impl = fused_adamw_reference
    return impl(
        params, grads, exp_avgs, exp_avg_sqs, model_params, grad_scale,
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
    )  # fmt: skip


@fused_adamw_op.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, model_params, grad_scale, lr, beta1, beta2, eps, weight_decay, step):
    return params[0].new_empty((), dtype=torch.float32)


def _check_group(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    model_params: list[Tensor],
    grad_scale: Tensor | None,
    step: int,
) -> None:
    if not params:
        raise ValueError("fused_adamw: params is empty; pass at least one tensor")
    roles = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    if model_params:
        roles["model_params"] = model_params
    for role, tensors in roles.items():
        if len(tensors) != len(params):
            raise ValueError(f"fused_adamw: {role} has {len(tensors)} tensors but params has {len(params)}")
        for i, (p, t) in enumerate(zip(params, tensors, strict=True)):
            if t.shape != p.shape:
                raise ValueError(f"fused_adamw: {role}[{i}] shape {tuple(t.shape)} != params[{i}] {tuple(p.shape)}")
    if grad_scale is not None and (grad_scale.numel() != 1 or grad_scale.device != params[0].device):
        raise ValueError(
            f"fused_adamw: grad_scale must be a one-element tensor on {params[0].device}; "
            f"got {tuple(grad_scale.shape)} on {grad_scale.device}"
        )
    if step < 1:
        raise ValueError(f"fused_adamw: step={step} must be >= 1 (the count including this update)")


def fused_adamw(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    model_params: list[Tensor] | None = None,
    grad_scale: Tensor | None = None,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    step: int,
) -> Tensor:
    """One AdamW step on a group, in place. `params` are the (fp32 master) weights; `model_params`, if
    given, receive the updated weights in their own dtype. Returns found_inf (0-d fp32, on device)."""
    model_params = list(model_params or [])
    _check_group(params, grads, exp_avgs, exp_avg_sqs, model_params, grad_scale, step)
    with torch.no_grad():
        return fused_adamw_op(
            list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), model_params, grad_scale,
            float(lr), float(betas[0]), float(betas[1]), float(eps), float(weight_decay), int(step),
        )  # fmt: skip
