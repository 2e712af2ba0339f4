"""Block quantization of a flat fp32 buffer to int8 or int4 (two values per byte), and its inverse.

Called by `engine/gradcomp/reduce.py` for the compressed gradient reductions. Pure torch (the CPU path and
the specification); torch has no quantized collective, and `torch.ao` quantizes weights and activations,
not wire payloads.

Per block of `block` elements: scale = max|x| / qmax (qmax 127 for int8, 7 for int4), q = round(x / scale)
clamped to [-qmax, qmax]; a block of zeros has scale 0 and decodes to zeros. int4 stores q + 8 in a nibble,
even elements in the low nibble. Shapes: x (n,), n a multiple of `block` (and of 2 for int4); codes
(n,) int8 or (n / 2,) uint8; scales (n / block,) fp32.
"""

from __future__ import annotations

import torch

QMAX = {8: 127, 4: 7}


def quantize(x: torch.Tensor, *, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of the flat fp32 tensor `x` (see the module docstring)."""
    qmax = QMAX[bits]
    blocks = x.view(-1, block)                                            # (n / block, block)
    scales = blocks.abs().amax(1) / qmax                                   # (n / block,)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8).view(-1)  # (n,)
    if bits == 8:
        return q, scales
    nibbles = (q + 8).to(torch.uint8).view(-1, 2)                          # (n / 2, 2)
    return nibbles[:, 0] | (nibbles[:, 1] << 4), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, *, bits: int, block: int) -> torch.Tensor:
    """The fp32 values (n,) that `quantize` encoded."""
    if bits == 8:
        q = codes.to(torch.float32)
    else:
        low = (codes & 0x0F).to(torch.float32) - 8
        high = (codes >> 4).to(torch.float32) - 8
        q = torch.stack([low, high], dim=1).view(-1)                       # (n,)
    return (q.view(-1, block) * scales[:, None]).view(-1)
