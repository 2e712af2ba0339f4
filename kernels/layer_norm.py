"""LayerNorm over the last dimension: `y = (x - mean) / sqrt(var + eps) * weight + bias`, fwd and bwd.

For users' model code, as `layer_norm(x, weight, bias, eps)`; nothing in deepfleet calls it yet. The
pure-torch functions here are the specification and the CPU path; `deepfleet::layer_norm` is the custom
op that dispatches to them or to `kernels/_triton/layer_norm.py` (see `_dispatch`).

Precision: all math in fp32 (float64 stays float64); biased variance as in `torch.nn.LayerNorm`;
outputs in the input dtype; mean and rstd stay fp32 and are saved for the backward pass.
Shapes: x (..., n), weight (n,), bias (n,) or None, mean and rstd (...,).
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepfleet.kernels._dispatch import triton_module, use_triton


def _acc(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def layer_norm_reference(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """The specification: differentiable pure torch, fp32 accumulation, output in x.dtype."""
    xf = _acc(x)
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps) * _acc(weight)
    if bias is not None:
        y = y + _acc(bias)
    return y.to(x.dtype)


def layer_norm_forward_reference(
    x: Tensor, weight: Tensor, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Forward returning (y, mean, rstd) as the kernel does; mean and rstd (...,) in fp32."""
    xf = _acc(x)
    mean = xf.mean(-1)  # (...,)
    rstd = torch.rsqrt((xf - mean.unsqueeze(-1)).pow(2).mean(-1) + eps)  # (...,)
    y = (xf - mean.unsqueeze(-1)) * rstd.unsqueeze(-1) * _acc(weight)
    if bias is not None:
        y = y + _acc(bias)
    return y.to(x.dtype), mean, rstd


def layer_norm_backward_reference(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dx, dweight, dbias) from the saved mean and rstd.

    With xhat = (x - mean) * rstd and g = dy * weight:
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), dweight = sum_rows dy * xhat, dbias = sum_rows dy.
    """
    xf, dyf = _acc(x), _acc(dy)
    r = rstd.to(xf.dtype).unsqueeze(-1)
    xhat = (xf - mean.to(xf.dtype).unsqueeze(-1)) * r
    g = dyf * _acc(weight)
    dx = r * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    n = x.shape[-1]
    dw = (dyf * xhat).reshape(-1, n).sum(0)
    db = dyf.reshape(-1, n).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype), db.to(weight.dtype)


@torch.library.custom_op("deepfleet::layer_norm", mutates_args=())
def layer_norm_op(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (y, mean, rstd)."""
    if use_triton(x, weight):
        return triton_module("layer_norm").layer_norm_forward(x, weight, bias, eps)
    return layer_norm_forward_reference(x, weight, bias, eps)


@layer_norm_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    stat = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x), stat, torch.empty_like(stat)


@torch.library.custom_op("deepfleet::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (dx, dweight, dbias); dbias is returned even when the forward had no bias."""
    if use_triton(dy, x, weight):
        return triton_module("layer_norm").layer_norm_backward(dy, x, weight, mean, rstd)
    return layer_norm_backward_reference(dy, x, weight, mean, rstd)


@layer_norm_backward_op.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, mean, rstd)


def _backward(ctx, dy: Tensor, _dmean: Tensor, _drstd: Tensor) -> tuple[Tensor, Tensor, Tensor | None, None]:
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_backward_op(dy, x, weight, mean, rstd)
    return dx, dw, (db if ctx.has_bias else None), None


layer_norm_op.register_autograd(_backward, setup_context=_setup_context)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm of x (..., n) with weight (n,) and optional bias (n,); differentiable."""
    n = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"layer_norm: {name} shape {tuple(t.shape)} must be ({n},), the last dim of x")
    return layer_norm_op(x, weight, bias, eps)[0]
