"""Rotary position embedding (rotate-half convention, as in GPT-NeoX and Llama), forward and backward.

For users' attention code, as `rope(q, cos, sin)` and `rope(k, cos, sin)`, with tables from
`rope_cos_sin`; nothing in deepfleet calls it yet. The pure-torch functions here are the specification
and the CPU path; `deepfleet::rope` is the custom op that dispatches to them or to
`kernels/_triton/rope.py` (see `_dispatch`).

Shapes: x (batch, seq, heads, head_dim) with head_dim even; cos, sin (seq, head_dim // 2), fp32.
With x = [x1, x2] split in halves of the last dim:
  y1 = x1 * cos - x2 * sin,  y2 = x2 * cos + x1 * sin        (a rotation of each (x1_j, x2_j) pair)
The backward pass is the inverse rotation (sin -> -sin), so one op with an `inverse` flag serves both.
The tables are treated as constants (no gradient flows to cos/sin).
Precision: math in fp32 (float64 stays float64), output in x's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepfleet.kernels._dispatch import triton_module, use_triton


def rope_cos_sin(
    seq_len: int, head_dim: int, *, base: float = 10000.0, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """fp32 tables (seq_len, head_dim // 2): angle[s, j] = s * base ** (-2j / head_dim)."""
    if head_dim % 2:
        raise ValueError(f"rope_cos_sin: head_dim={head_dim} must be even")
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angle = torch.arange(seq_len, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return angle.cos().float(), angle.sin().float()


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """The specification: differentiable pure torch, fp32 math, output in x.dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    half = x.shape[-1] // 2
    x1, x2 = x.to(acc)[..., :half], x.to(acc)[..., half:]  # (batch, seq, heads, half)
    c = cos.to(acc)[:, None, :]  # (seq, 1, half) broadcasts over batch and heads
    s = sin.to(acc)[:, None, :] * (-1 if inverse else 1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


@torch.library.custom_op("deepfleet::rope", mutates_args=())
def rope_op(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """Rotates x by the tables (inverse=True rotates back: the backward pass)."""
    if use_triton(x, cos, sin):
        return triton_module("rope").rope(x, cos, sin, inverse)
    return rope_reference(x, cos, sin, inverse)


@rope_op.register_fake
def _(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output) -> None:
    _, cos, sin, ctx.inverse = inputs
    ctx.save_for_backward(cos, sin)


def _backward(ctx, dy: Tensor) -> tuple[Tensor, None, None, None]:
    cos, sin = ctx.saved_tensors
    return rope_op(dy, cos, sin, not ctx.inverse), None, None, None


rope_op.register_autograd(_backward, setup_context=_setup_context)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply rotary embedding to x (batch, seq, heads, head_dim); differentiable in x."""
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"rope: x shape {tuple(x.shape)} must be (batch, seq, heads, head_dim) with head_dim even")
    expected = (x.shape[1], x.shape[-1] // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != expected:
            raise ValueError(f"rope: {name} shape {tuple(t.shape)} must be (seq, head_dim // 2) = {expected}")
    return rope_op(x, cos, sin, False)
