"""Triton RMSNorm forward and backward; the specification is `kernels/rms_norm.py`.

Called only through `deepfleet::rms_norm` / `deepfleet::rms_norm_backward` when the Triton path is
selected. One program per row holds the row in registers (fp32); the weight gradient is reduced in two
stages (per-program fp32 partials, then a torch sum) so no atomics decide the summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from deepfleet.kernels._triton.launch import flatten_rows, reduction_programs, row_block


@triton.jit
def _rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.store(y_ptr + row * n_cols + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols, rows_per_program, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, rows_per_program):
        row = (pid * rows_per_program + i).to(tl.int64)
        # rows past the end load zeros (and so add nothing to dw); a block mask, not a scalar one
        mask = cols < tl.where(row < n_rows, n_cols, 0)
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + tl.minimum(row, n_rows - 1))
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_part_ptr + pid * n_cols + cols, dw, mask=col_mask)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = flatten_rows(x)  # (rows, n)
    rows, n = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    if rows:
        _rms_norm_fwd[(rows,)](x2, weight.contiguous(), y, rstd, n, eps, BLOCK=row_block(n))
    return y.view(x.shape), rstd.view(x.shape[:-1])


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    x2, dy2 = flatten_rows(x), flatten_rows(dy)  # (rows, n)
    rows, n = x2.shape
    dx = torch.empty_like(x2)
    programs = reduction_programs(x.device, rows)
    dw_part = torch.zeros(programs, n, device=x.device, dtype=torch.float32)
    if rows:
        per = triton.cdiv(rows, programs)
        _rms_norm_bwd[(programs,)](
            dy2, x2, weight.contiguous(), rstd.contiguous(), dx, dw_part, rows, n, per, BLOCK=row_block(n)
        )
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype)
