"""Triton LayerNorm forward and backward; the specification is `kernels/layer_norm.py`.

Called only through `deepfleet::layer_norm` / `deepfleet::layer_norm_backward` when the Triton path is
selected. One program per row holds the row in registers (fp32); weight and bias gradients are reduced in
two stages (per-program fp32 partials, then a torch sum) so no atomics decide the summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepfleet.kernels._triton.launch import flatten_rows, reduction_programs, row_block


@triton.jit
def _layer_norm_fwd(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_cols, eps, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    xc = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
    y = xc * rstd * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
    n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = (pid * rows_per_program + i).to(tl.int64)
        mask = cols < tl.where(row < n_rows, n_cols, 0)  # rows past the end load zeros
        last = tl.minimum(row, n_rows - 1)
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + last)
        xhat = tl.where(mask, (x - tl.load(mean_ptr + last)) * rstd, 0.0)
        g = dy * w
        dx = rstd * (g - tl.sum(g, axis=0) / n_cols - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(dw_part_ptr + pid * n_cols + cols, dw, mask=col_mask)
    tl.store(db_part_ptr + pid * n_cols + cols, db, mask=col_mask)


def layer_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x2 = flatten_rows(x)  # (rows, n)
    rows, n = x2.shape
    y = torch.empty_like(x2)
    mean = torch.empty(rows, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    w = weight.contiguous()
    if rows:
        b = bias.contiguous() if bias is not None else w  # unread when HAS_BIAS is False
        _layer_norm_fwd[(rows,)](
            x2, w, b, y, mean, rstd, n, eps, HAS_BIAS=bias is not None, BLOCK=row_block(n)
        )
    stat_shape = x.shape[:-1]
    return y.view(x.shape), mean.view(stat_shape), rstd.view(stat_shape)


def layer_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x2, dy2 = flatten_rows(x), flatten_rows(dy)  # (rows, n)
    rows, n = x2.shape
    dx = torch.empty_like(x2)
    programs = reduction_programs(x.device, rows)
    dw_part = torch.zeros(programs, n, device=x.device, dtype=torch.float32)
    db_part = torch.zeros_like(dw_part)
    if rows:
        _layer_norm_bwd[(programs,)](
            dy2, x2, weight.contiguous(), mean.contiguous(), rstd.contiguous(), dx, dw_part, db_part,
            rows, n, triton.cdiv(rows, programs), BLOCK=row_block(n),
        )  # fmt: skip
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(weight.dtype)
