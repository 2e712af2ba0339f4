"""Triton fused AdamW; the specification is `kernels/fused_adamw.py`.

Called only through `deepfleet::fused_adamw` when the Triton path is selected. Each tensor of the group
is one launch over its flat elements (a ZeRO flat buffer is one tensor, so one launch). With a
grad_scale, a first pass unscales and checks the gradients (one atomic max per block into `found_inf`),
and the update pass reads `found_inf` on the device and writes nothing when it is set: no host sync.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _check_finite(g_ptr, scale_ptr, found_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(scale_ptr).to(tl.float32)
    bad = tl.max(tl.where(tl.abs(g) < float("inf"), 0, 1), axis=0)  # nan fails the comparison too
    tl.atomic_max(found_ptr, bad)


@triton.jit
def _adamw(
    p_ptr, g_ptr, m_ptr, v_ptr, model_ptr, scale_ptr, found_ptr,
    n, lr, beta1, beta2, eps, weight_decay, bias1, bias2_sqrt,
    HAS_MODEL: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_SCALE:
        mask = offs < tl.where(tl.load(found_ptr) == 0, n, 0)  # overflow: touch nothing
    else:
        mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32) * (1.0 - lr * weight_decay)
    m = beta1 * tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32) + (1.0 - beta1) * g
    v = beta2 * tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32) + (1.0 - beta2) * g * g
    p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    if HAS_MODEL:
        tl.store(model_ptr + offs, p.to(model_ptr.dtype.element_ty), mask=mask)


def fused_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    model_params: list[torch.Tensor],
    grad_scale: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> torch.Tensor:
    device = params[0].device
    found = torch.zeros((), dtype=torch.int32, device=device)
    tensors = [params, grads, exp_avgs, exp_avg_sqs, *([model_params] if model_params else [])]
    if not all(t.is_contiguous() for role in tensors for t in role):
        raise ValueError("fused_adamw (triton): every tensor must be contiguous; pass flat buffers or .contiguous()")
    if grad_scale is not None:
        for g in grads:
            if g.numel():
                _check_finite[(triton.cdiv(g.numel(), BLOCK),)](g, grad_scale, found, g.numel(), BLOCK=BLOCK)
    bias1, bias2_sqrt = 1 - beta1**step, math.sqrt(1 - beta2**step)
    scale = grad_scale if grad_scale is not None else found  # unread when HAS_SCALE is False
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        if not p.numel():
            continue
        _adamw[(triton.cdiv(p.numel(), BLOCK),)](
            p, g, m, v, model_params[i] if model_params else p, scale, found,
            p.numel(), lr, beta1, beta2, eps, weight_decay, bias1, bias2_sqrt,
            HAS_MODEL=bool(model_params), HAS_SCALE=grad_scale is not None, BLOCK=BLOCK,
        )  # fmt: skip
    return found.to(torch.float32)
