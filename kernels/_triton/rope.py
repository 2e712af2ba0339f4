"""Triton rotary embedding (forward, and backward as the inverse rotation); the specification is
`kernels/rope.py`.

Called only through `deepfleet::rope` when the Triton path is selected. One program per (batch, seq)
position rotates all heads at once, so the position's cos/sin row is loaded once and reused.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope(
    x_ptr, cos_ptr, sin_ptr, y_ptr, seq_len, n_heads, half, sign,
    HEADS: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # flat (batch, seq) index
    pos = row % seq_len
    heads = tl.arange(0, HEADS)[:, None]  # (HEADS, 1)
    cols = tl.arange(0, HALF)[None, :]  # (1, HALF)
    col_mask = cols < half
    mask = (heads < n_heads) & col_mask
    c = tl.load(cos_ptr + pos * half + cols, mask=col_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * half + cols, mask=col_mask, other=0.0).to(tl.float32) * sign
    base = row * n_heads * 2 * half + heads * 2 * half + cols  # (HEADS, HALF) offsets of x1
    x1 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + base, (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + base + half, (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    x = x.contiguous()  # (batch, seq, heads, head_dim)
    batch, seq, heads, head_dim = x.shape
    y = torch.empty_like(x)
    half = head_dim // 2
    if x.numel():
        _rope[(batch * seq,)](
            x, cos.contiguous(), sin.contiguous(), y, seq, heads, half, -1.0 if inverse else 1.0,
            HEADS=triton.next_power_of_2(heads), HALF=max(2, triton.next_power_of_2(half)),
        )  # fmt: skip
    return y
