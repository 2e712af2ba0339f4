"""Triton 1-bit pack (sign + per-chunk scale + error feedback) and unpack; the specification is
`kernels/onebit_pack.py`.

Called only through `deepfleet::onebit_pack` / `deepfleet::onebit_unpack` when the Triton path is
selected. One program per chunk: the chunk is loaded as a (bytes, 8) block, so packing is a shift and a
sum along the second axis and needs no reshape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pack(x_ptr, err_ptr, packed_ptr, scale_ptr, n, chunk_size, BYTES: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    byte = tl.arange(0, BYTES)[:, None]  # (BYTES, 1) byte index within the chunk
    bit = tl.arange(0, 8)[None, :]  # (1, 8)
    idx = chunk * chunk_size + byte * 8 + bit  # (BYTES, 8) element index
    mask = (byte * 8 + bit < chunk_size) & (idx < n)
    c = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32) + tl.load(err_ptr + idx, mask=mask, other=0.0)
    count = tl.minimum(chunk_size, n - chunk * chunk_size)
    scale = tl.sum(tl.sum(tl.abs(c), axis=1), axis=0) / count
    positive = c >= 0
    tl.store(err_ptr + idx, c - tl.where(positive, scale, -scale), mask=mask)
    bits = tl.where(positive & mask, 1, 0) << bit  # (BYTES, 8) int32
    byte1 = tl.arange(0, BYTES)  # (BYTES,) the same byte index, one-dimensional
    byte_mask = (byte1 * 8 < chunk_size) & (chunk * chunk_size + byte1 * 8 < n)
    tl.store(packed_ptr + chunk * (chunk_size // 8) + byte1, tl.sum(bits, axis=1).to(tl.uint8), mask=byte_mask)
    tl.store(scale_ptr + chunk, scale)


@triton.jit
def _unpack(packed_ptr, scale_ptr, out_ptr, n, chunk_size, BYTES: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    byte = tl.arange(0, BYTES)[:, None]
    bit = tl.arange(0, 8)[None, :]
    idx = chunk * chunk_size + byte * 8 + bit
    mask = (byte * 8 + bit < chunk_size) & (idx < n)
    byte_mask = (byte * 8 < chunk_size) & (chunk * chunk_size + byte * 8 < n)  # (BYTES, 1)
    b = tl.load(packed_ptr + chunk * (chunk_size // 8) + byte, mask=byte_mask, other=0)
    on = ((b.to(tl.int32) >> bit) & 1) != 0
    scale = tl.load(scale_ptr + chunk)
    tl.store(out_ptr + idx, tl.where(on, scale, -scale).to(out_ptr.dtype.element_ty), mask=mask)


def onebit_pack(x: torch.Tensor, error: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.reshape(-1).contiguous()
    n = x.numel()
    chunks = triton.cdiv(n, chunk_size)
    packed = torch.empty(triton.cdiv(n, 8), dtype=torch.uint8, device=x.device)
    scales = torch.empty(chunks, dtype=torch.float32, device=x.device)
    if n:
        _pack[(chunks,)](x, error, packed, scales, n, chunk_size, BYTES=triton.next_power_of_2(chunk_size // 8))
    return packed, scales


def onebit_unpack(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, chunk_size: int, dtype: torch.dtype
) -> torch.Tensor:
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    if numel:
        _unpack[(triton.cdiv(numel, chunk_size),)](
            packed.contiguous(), scales.contiguous(), out, numel, chunk_size,
            BYTES=triton.next_power_of_2(chunk_size // 8),
        )  # fmt: skip
    return out
