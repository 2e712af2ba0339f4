"""Fake quantization with straight-through gradients, integer codes for export, and the bits schedule.

Called by `layers.py` (quantization-aware training: the forward sees quantized weights/activations,
the backward passes the gradient through unchanged) and by `export.py` (the same grid, stored as
int8/uint8 codes with per-group scales). The grid is DeepSpeed Compression's, so a model trained
here quantizes as it would there:

    symmetric,  b bits, per group g:  s = 2 * max|x_g| / 2^b,   q = clamp(round(x / s), -2^(b-1), 2^(b-1) - 1)
    asymmetric, b bits, per group g:  s = (max x_g - min x_g) / 2^b,  z = round(min x_g / s) * s,
                                      q = clamp(round((x - z) / s), 0, 2^b - 1),  x^ = q * s + z

Groups are contiguous slices of the flattened tensor (`quantize_groups` of them, so a weight of
shape (out, in) with groups == out is per-row). Written here rather than taken from torchao (not
installed in this environment, and its QAT fake-quantizers group along the input dimension with
their own scale formula; DeepSpeed's grid, grouping and bits schedule are what configs expect).
"""

from __future__ import annotations

import torch

_TINY = 1e-12  # floor of a scale, so an all-zero group quantizes to zeros instead of NaN


def _grid(x: torch.Tensor, bits: int, *, groups: int, symmetric: bool,
          min_max: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x as (groups, -1), scale (groups, 1), zero (groups, 1)) of the quantization grid."""
    flat = x.reshape(groups, -1)  # (groups, numel / groups)
    levels = 2**bits
    if min_max is not None:  # a static activation range (one group)
        lo, hi = (v.reshape(1, 1).to(flat.dtype) for v in min_max)
    else:
        lo, hi = flat.amin(dim=1, keepdim=True), flat.amax(dim=1, keepdim=True)
    if symmetric:
        scale = (2 * torch.maximum(lo.abs(), hi.abs()) / levels).clamp_min(_TINY)
        zero = torch.zeros_like(scale)
    else:
        scale = ((hi - lo) / levels).clamp_min(_TINY)
        zero = torch.round(lo / scale) * scale
    return flat, scale, zero


def quantize_codes(x: torch.Tensor, bits: int, *, groups: int = 1, symmetric: bool = True,
                   noise: torch.Tensor | None = None,
                   min_max: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer codes (groups, n) as float, scale (groups, 1) and zero (groups, 1) of `x`.

    `noise` (same numel as x, uniform in [-0.5, 0.5)) makes the rounding stochastic."""
    flat, scale, zero = _grid(x.detach(), bits, groups=groups, symmetric=symmetric, min_max=min_max)
    t = (flat - zero) / scale
    if noise is not None:
        t = t + noise.reshape(t.shape)
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)
    return torch.round(t).clamp(lo, hi), scale, zero


def fake_quantize(x: torch.Tensor, bits: int, *, groups: int = 1, symmetric: bool = True,
                  stochastic: bool = False,
                  min_max: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`x` rounded to its `bits`-bit grid, with a straight-through gradient (d out / d x = 1)."""
    noise = torch.rand(x.numel(), dtype=x.dtype, device=x.device) - 0.5 if stochastic else None
    codes, scale, zero = quantize_codes(x, bits, groups=groups, symmetric=symmetric, noise=noise, min_max=min_max)
    q = (codes * scale + zero).reshape(x.shape).to(x.dtype)
    return x + (q - x).detach()


def token_groups(x: torch.Tensor) -> int:
    """Groups for dynamic activation quantization: one per token (every vector along the last dim)."""
    return max(x.numel() // x.shape[-1], 1)


def scheduled_bits(steps: int, *, start_bits: int, target_bits: int, period: int) -> int:
    """Bits after `steps` steps of MoQ's schedule: one bit fewer each time `steps` reaches the period,
    which doubles after every drop (drops at period, 2*period, 4*period, ...), down to target_bits."""
    bits, threshold = start_bits, period
    while bits > target_bits and steps >= threshold:
        bits -= 1
        threshold *= 2
    return bits


def last_switch(steps: int, *, start_bits: int, target_bits: int, period: int) -> int:
    """The step (since the offset) of the last bits switch of `scheduled_bits`, 0 before the first."""
    drops = start_bits - scheduled_bits(steps, start_bits=start_bits, target_bits=target_bits, period=period)
    return 0 if drops == 0 else period * 2 ** (drops - 1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes (values 0..15, any shape with an even last dim) two per uint8: low nibble first."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: uint8 (..., n/2) -> uint8 codes (..., n)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)
