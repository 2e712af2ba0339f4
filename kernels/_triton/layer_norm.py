"""Triton LayerNorm forward and backward; the specification is `kernels/layer_norm.py`.

Called only through `deepfleet::layer_norm` / `deepfleet::layer_norm_backward` when the Triton path is
selected. A program holds a (rows, n) tile in registers (fp32; several rows when rows are short);
weight and bias gradients are reduced in two stages (per-program fp32 partials, then a torch sum) so no
atomics decide the summation order.
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
def _layer_norm_fwd(
    x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n_rows, n_cols, eps,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK)
    col_mask = cols < n_cols
    mask = (rows[:, None] < n_rows) & col_mask  # (ROWS, BLOCK)
    offs = rows.to(tl.int64)[:, None] * n_cols + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols  # (ROWS,)
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)  # (ROWS,)
    y = xc * rstd[:, None] * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(mean_ptr + rows, mean, mask=rows < n_rows)
    tl.store(rstd_ptr + rows, rstd, mask=rows < n_rows)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd(
    dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr, db_part_ptr,
    n_rows, n_cols, rows_per_program, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    db = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for i in range(0, rows_per_program, ROWS):  # rows_per_program is a multiple of ROWS
        rows = pid * rows_per_program + i + tl.arange(0, ROWS)  # (ROWS,)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_mask  # rows past the end load zeros
        offs = rows.to(tl.int64)[:, None] * n_cols + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)[:, None]
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)[:, None]
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy * w
        c1 = (tl.sum(g * xhat, axis=1) / n_cols)[:, None]
        c2 = (tl.sum(g, axis=1) / n_cols)[:, None]
        tl.store(dx_ptr + offs, (rstd * (g - c2 - xhat * c1)).to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    tl.store(dw_part_ptr + pid * n_cols + cols, tl.sum(dw, axis=0)[None, :], mask=col_mask)
    tl.store(db_part_ptr + pid * n_cols + cols, tl.sum(db, axis=0)[None, :], mask=col_mask)


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
        block = row_block(n)
        tile = rows_per_block(block)
        _layer_norm_fwd[(triton.cdiv(rows, tile),)](
            x2, w, b, y, mean, rstd, rows, n, eps,
            HAS_BIAS=bias is not None, ROWS=tile, BLOCK=block, num_warps=num_warps(block),
        )  # fmt: skip
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
        block = row_block(n)
        tile = rows_per_block(block)
        per = triton.cdiv(triton.cdiv(rows, programs), tile) * tile
        _layer_norm_bwd[(programs,)](
            dy2, x2, weight.contiguous(), mean.contiguous(), rstd.contiguous(), dx, dw_part, db_part,
            rows, n, per, ROWS=tile, BLOCK=block, num_warps=num_warps(block),
        )  # fmt: skip
    return dx.view(x.shape), dw_part.sum(0).to(weight.dtype), db_part.sum(0).to(weight.dtype)
