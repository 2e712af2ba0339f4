"""Triton MoE permute / unpermute (and unpermute's backward); the specification is
`kernels/moe_permute.py`.

Called only through `deepfleet::moe_permute`, `deepfleet::moe_unpermute` and
`deepfleet::moe_unpermute_backward` when the Triton path is selected. One program per token walks its k
assignments and the hidden dimension in BLOCK-wide slices; every destination row is written by exactly
one program, so no atomics are needed. Dropped assignments (row -1) are masked out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 1024


@triton.jit
def _permute(x_ptr, map_ptr, out_ptr, d, k, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    for j in range(0, k):
        r = tl.load(map_ptr + t * k + j)
        limit = tl.where(r >= 0, d, 0)  # a dropped assignment writes nothing
        for start in range(0, d, BLOCK):
            mask = start + cols < limit
            v = tl.load(x_ptr + t * d + start + cols, mask=mask, other=0.0)
            tl.store(out_ptr + tl.maximum(r, 0) * d + start + cols, v, mask=mask)


@triton.jit
def _unpermute(y_ptr, map_ptr, g_ptr, out_ptr, d, k, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    for start in range(0, d, BLOCK):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(0, k):
            r = tl.load(map_ptr + t * k + j)
            g = tl.load(g_ptr + t * k + j).to(tl.float32)
            mask = start + cols < tl.where(r >= 0, d, 0)
            acc += g * tl.load(y_ptr + tl.maximum(r, 0) * d + start + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * d + start + cols, acc.to(out_ptr.dtype.element_ty), mask=start + cols < d)


@triton.jit
def _unpermute_bwd(dout_ptr, y_ptr, map_ptr, g_ptr, dy_ptr, dg_ptr, d, k, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    for j in range(0, k):
        r = tl.load(map_ptr + t * k + j)
        g = tl.load(g_ptr + t * k + j).to(tl.float32)
        limit = tl.where(r >= 0, d, 0)
        dot = 0.0
        for start in range(0, d, BLOCK):
            mask = start + cols < limit
            dout = tl.load(dout_ptr + t * d + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + tl.maximum(r, 0) * d + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dy_ptr + tl.maximum(r, 0) * d + start + cols, (g * dout).to(dy_ptr.dtype.element_ty), mask=mask)
            dot += tl.sum(dout * y, axis=0)
        tl.store(dg_ptr + t * k + j, dot.to(dg_ptr.dtype.element_ty))


def _block(d: int) -> int:
    return min(MAX_BLOCK, max(16, triton.next_power_of_2(d)))


def moe_permute(x: torch.Tensor, row_map: torch.Tensor, num_rows: int) -> torch.Tensor:
    x, row_map = x.contiguous(), row_map.contiguous()
    tokens, d = x.shape
    out = torch.zeros(num_rows, d, dtype=x.dtype, device=x.device)  # rows nobody fills stay zero
    if tokens and d:
        _permute[(tokens,)](x, row_map, out, d, row_map.shape[1], BLOCK=_block(d))
    return out


def moe_unpermute(y: torch.Tensor, row_map: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    y, row_map, gates = y.contiguous(), row_map.contiguous(), gates.contiguous()
    tokens, d = row_map.shape[0], y.shape[1]
    out = torch.empty(tokens, d, dtype=y.dtype, device=y.device)
    if tokens and d:
        _unpermute[(tokens,)](y, row_map, gates, out, d, row_map.shape[1], BLOCK=_block(d))
    return out


def moe_unpermute_backward(
    dout: torch.Tensor, y: torch.Tensor, row_map: torch.Tensor, gates: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dout, y, row_map, gates = dout.contiguous(), y.contiguous(), row_map.contiguous(), gates.contiguous()
    tokens, d = dout.shape
    dy = torch.zeros_like(y)  # rows no assignment reads get zero gradient
    dgates = torch.zeros_like(gates)
    if tokens and d:
        _unpermute_bwd[(tokens,)](dout, y, row_map, gates, dy, dgates, d, row_map.shape[1], BLOCK=_block(d))
    return dy, dgates
