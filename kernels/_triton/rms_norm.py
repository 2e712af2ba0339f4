"""Triton RMSNorm forward and backward; the specification is `kernels/rms_norm.py`.

Called only through `deepfleet::rms_norm` / `deepfleet::rms_norm_backward` when the Triton path is
selected. A program holds a (rows, n) tile in registers (fp32; several rows when rows are short); the
weight gradient is reduced in two stages (per-program fp32 partials, then a torch sum) so no atomics
decide the summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepfleet.kernels._triton.launch import (
    flatten_rows,
    num_warps,
    reduction_programs,
    row_block,
    rows_per_block,
)


@triton.jit
def _rms_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK)
    mask = (rows[:, None] < n_rows) & (cols < n_cols)  # (ROWS, BLOCK)
    offs = rows.to(tl.int64)[:, None] * n_cols + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)  # (ROWS,)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)
    tl.store(y_ptr + offs, (x * rstd[:, None] * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, n_rows, n_cols, rows_per_program,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for i in range(0, rows_per_program, ROWS):  # rows_per_program is a multiple of ROWS
        rows = pid * rows_per_program + i + tl.arange(0, ROWS)  # (ROWS,)
        mask = (rows[:, None] < n_rows) & (cols < n_cols)  # rows past the end load zeros
        offs = rows.to(tl.int64)[:, None] * n_cols + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < n_rows, other=0.0)[:, None]
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=1) / n_cols)[:, None])
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_part_ptr + pid * n_cols + cols, tl.sum(dw, axis=0)[None, :], mask=cols < n_cols)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = flatten_rows(x)  # (rows, n)
    rows, n = x2.shape
    y = torch.empty_like(x2)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    if rows:
        block = row_block(n)
        tile = rows_per_block(block)
        _rms_norm_fwd[(triton.cdiv(rows, tile),)](
            x2, weight.contiguous(), y, rstd, rows, n, eps, ROWS=tile, BLOCK=block, num_warps=num_warps(block)
        )
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
        block = row_block(n)
        tile = rows_per_block(block)
        per = triton.cdiv(triton.cdiv(rows, programs), tile) * tile
        _rms_norm_bwd[(programs,)](
            dy2, x2, weight.contiguous(), rstd.contiguous(), dx, dw_part, rows, n, per,
            ROWS=tile, BLOCK=block, num_warps=num_warps(block),
        )  # fmt: skip
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype)
