"""Triton cross-entropy forward (loss and per-row gradient in one kernel) and backward (row scaling);
the specification is `kernels/cross_entropy.py`.

Called only through `deepfleet::cross_entropy` / `deepfleet::cross_entropy_backward` when the Triton
path is selected. One program per row walks the vocabulary in BLOCK-sized chunks twice: first an online
max / sum-exp (and the row sum for label smoothing), then the gradient softmax - onehot - e/V written in
the logits' dtype. Nothing of size (rows, vocab) is ever held in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 8192  # vocab chunk per loop iteration (fp32 registers per program)


@triton.jit
def _cross_entropy_fwd(
    x_ptr, t_ptr, loss_ptr, g_ptr, n_cols, ignore_index, smoothing,
    COMPUTE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    target = tl.load(t_ptr + row)
    cols = tl.arange(0, BLOCK)
    valid = target != ignore_index  # ignored rows get loss 0 and gradient 0
    safe_target = tl.where(valid, target, 0)
    m = float("-inf")  # running max
    s = 0.0  # running sum of exp(x - m)
    total = 0.0  # sum of x, for label smoothing
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        total += tl.sum(tl.where(mask, x, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    x_t = tl.load(x_row + safe_target).to(tl.float32)
    loss = lse - (1.0 - smoothing) * x_t - smoothing * total / n_cols
    tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
    if COMPUTE_GRAD:
        for start in range(0, n_cols, BLOCK):
            idx = start + cols
            mask = idx < n_cols
            x = tl.load(x_row + idx, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - smoothing / n_cols - tl.where(idx == safe_target, 1.0 - smoothing, 0.0)
            g = tl.where(valid, g, 0.0)
            tl.store(g_ptr + row * n_cols + idx, g.to(g_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_rows(g_ptr, d_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    idx = start + tl.arange(0, BLOCK)
    mask = idx < n_cols
    d = tl.load(d_ptr + row).to(tl.float32)
    g = tl.load(g_ptr + row * n_cols + idx, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + idx, (g * d).to(out_ptr.dtype.element_ty), mask=mask)


def _block(n_cols: int) -> int:
    return min(MAX_BLOCK, max(16, triton.next_power_of_2(n_cols)))


def cross_entropy_forward(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, compute_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.contiguous()  # (rows, vocab)
    rows, vocab = x.shape
    loss_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    losses = torch.empty(rows, device=x.device, dtype=loss_dtype)
    grad = torch.empty_like(x) if compute_grad else x.new_empty(0)
    if rows:
        _cross_entropy_fwd[(rows,)](
            x, target.contiguous(), losses, grad if compute_grad else x, vocab, ignore_index, label_smoothing,
            COMPUTE_GRAD=compute_grad, BLOCK=_block(vocab), num_warps=8,
        )  # fmt: skip
    return losses, grad


def cross_entropy_backward(row_grad: torch.Tensor, dloss: torch.Tensor) -> torch.Tensor:
    rows, vocab = row_grad.shape
    out = torch.empty_like(row_grad)
    block = _block(vocab)
    if rows:
        _scale_rows[(rows, triton.cdiv(vocab, block))](row_grad, dloss.contiguous(), out, vocab, BLOCK=block)
    return out
