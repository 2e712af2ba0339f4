"""RMSNorm over the last dimension: `y = x / sqrt(mean(x**2) + eps) * weight`, forward and backward.

For users' model code, as `rms_norm(x, weight, eps)`; nothing in deepfleet calls it yet. The pure-torch
functions here are the specification and the CPU path; `deepfleet::rms_norm` is the custom op that
dispatches to them or to `kernels/_triton/rms_norm.py` (see `_dispatch`).

Precision: all math in fp32 (float64 stays float64, for gradcheck); outputs are cast back to the input
dtype, `rstd` stays fp32 and is saved for the backward pass.
Shapes: x (..., n), weight (n,), rstd (...,).
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepfleet.kernels._dispatch import triton_module, use_triton


def _acc(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """The specification: differentiable pure torch, fp32 accumulation, output in x.dtype."""
    xf = _acc(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * _acc(weight)).to(x.dtype)


def rms_norm_forward_reference(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Forward returning (y, rstd) as the kernel does; rstd (...,) in fp32."""
    xf = _acc(x)
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)  # (...,)
    return (xf * rstd.unsqueeze(-1) * _acc(weight)).to(x.dtype), rstd


def rms_norm_backward_reference(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients (dx, dweight) from the saved rstd.

    With xhat = x * rstd and g = dy * weight: dx = rstd * (g - xhat * mean(g * xhat)),
    dweight = sum over rows of dy * xhat.
    """
    xf, dyf = _acc(x), _acc(dy)
    r = rstd.to(xf.dtype).unsqueeze(-1)
    xhat = xf * r
    g = dyf * _acc(weight)
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


@torch.library.custom_op("deepfleet::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Returns (y, rstd)."""
    if use_triton(x, weight):
        return triton_module("rms_norm").rms_norm_forward(x, weight, eps)
    return rms_norm_forward_reference(x, weight, eps)


@rms_norm_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("deepfleet::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    """Returns (dx, dweight)."""
    if use_triton(dy, x, weight):
        return triton_module("rms_norm").rms_norm_backward(dy, x, weight, rstd)
    return rms_norm_backward_reference(dy, x, weight, rstd)


@rms_norm_backward_op.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, weight, rstd)


def _backward(ctx, dy: Tensor, _drstd: Tensor) -> tuple[Tensor, Tensor, None]:
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(dy, x, weight, rstd)
    return dx, dw, None


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """RMSNorm of x (..., n) with weight (n,); differentiable; Triton on CUDA when selected."""
    if x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} must be ({x.shape[-1]},), the last dim of x")
    return rms_norm_op(x, weight, eps)[0]
