"""Weight-only int8 and int4 quantization of the decoder's linear layers.

Called by `engine.InferenceEngine` when `dtype=int8` or `quant.weight.num_bits` is set, after tensor
parallelism has cut the weights (each rank quantizes only its shard) and after projections were fused.
Activations stay in the compute dtype; the weights are stored as integers and dequantized per call
(one vectorized multiply-add into the compute dtype, then the ordinary matmul):
- int8: symmetric, one scale per output channel: w ~ q * s, q in [-128, 127];
- int4: asymmetric, one scale and minimum per `group_size` input columns: w ~ q * s + m, q in [0, 15],
  two codes per byte (low nibble = even column). A layer whose input width `group_size` does not
  divide uses one group per row.
So the figure this buys is memory (weights 0.25x / ~0.16x of fp32 plus scales), not speed on CPU.
Why not PyTorch's weight-only CPU kernels (`torch._weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`,
which torchao's CPU layouts lower to): measured on this machine for a 256x768 layer they are 12x (M=1)
to 60x (M=512) slower than dequantize + matmul, and 17x slower than fp32 at one row; and torchao's
int8 weight-only measured 0.94x of fp32 here, so it would add a dependency without a gain.

Which layers: every q/k/v/o and MLP projection (fused or not), and the output head unless it is tied to
the embedding. Layers a compressed model was cleaned into (`engine/compression/quantized.py`) already
hold integer codes and are left as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepfleet.engine.inference.decoder import PROJECTIONS, Decoder


class Int8Linear(nn.Module):
    """y = x @ (q * s).T + b with q int8 (out, in) and s (out,) fp32."""

    bits = 8

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scale)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return (self.weight.to(dtype) * self.scales.to(dtype)[:, None])

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dequantize(x.dtype), self.bias)


class Int4Linear(nn.Module):
    """Group-wise asymmetric int4 weights, two codes per byte (module docstring)."""

    bits = 4

    def __init__(self, linear: nn.Linear, *, group_size: int) -> None:
        super().__init__()
        out_f, in_f = linear.weight.shape
        if in_f % 2:
            raise ValueError(f"int4: input width {in_f} must be even (two codes per byte)")
        group_size = group_size if in_f % group_size == 0 else in_f
        w = linear.weight.detach().float().reshape(out_f, in_f // group_size, group_size)
        lo, hi = w.amin(-1), w.amax(-1)  # (out, groups)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        codes = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(out_f, in_f)
        self.register_buffer("weight", codes[:, 0::2] | (codes[:, 1::2] << 4))  # (out, in / 2)
        self.register_buffer("scales", scale)
        self.register_buffer("mins", lo)
        self.group_size = group_size
        self.bias = linear.bias
        self.in_features, self.out_features = in_f, out_f

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        out_f, in_f = self.out_features, self.in_features
        codes = torch.stack([self.weight & 15, self.weight >> 4], dim=-1).reshape(out_f, -1, self.group_size)
        w = codes.to(dtype) * self.scales.to(dtype)[..., None] + self.mins.to(dtype)[..., None]
        return w.reshape(out_f, in_f)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.dequantize(x.dtype), self.bias)


def quantize_linear(linear: nn.Linear, *, bits: int, group_size: int = 64) -> nn.Module:
    if bits == 4 and linear.in_features % 2 == 0:
        return Int4Linear(linear, group_size=group_size)
    return Int8Linear(linear)


@torch.no_grad()
def quantize_decoder(decoder: Decoder, *, bits: int, group_size: int = 64) -> Decoder:
    """Replace the decoder's nn.Linear projections in place (see the module docstring)."""
    if bits not in (4, 8):
        raise ValueError(f"quant.weight.num_bits: {bits} is not supported; use 8 or 4")
    for layer in decoder.layers:
        for name in PROJECTIONS:
            module = getattr(layer, name)
            if type(module) is nn.Linear:
                setattr(layer, name, quantize_linear(module, bits=bits, group_size=group_size))
            elif type(getattr(module, "linear", None)) is nn.Linear:  # a tensor-parallel row shard
                module.linear = quantize_linear(module.linear, bits=bits, group_size=group_size)
    head = decoder.head
    if type(head) is nn.Linear and head.weight is not getattr(decoder.embed, "weight", None):
        decoder.head = quantize_linear(head, bits=bits, group_size=group_size)
    return decoder
