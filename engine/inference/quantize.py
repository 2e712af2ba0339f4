"""Weight-only int8 and int4 quantization of the decoder's linear layers.

Called by `engine.InferenceEngine` when `dtype=int8` or `quant.weight.num_bits` is set, after tensor
parallelism has cut the weights (each rank quantizes only its shard). Activations stay in the compute
dtype; only the weights are stored as integers, and the matmul runs on PyTorch's weight-only kernels,
which dequantize inside the kernel instead of materializing a float weight:
- int8: symmetric, one scale per output channel: w ~ q * s, q in [-128, 127];
  `torch._weight_int8pack_mm(x, q, s)`.
- int4: asymmetric, one scale and zero per `group_size` input columns: w ~ (q - 8) * s + z' with q in
  [0, 15] (z' = min + 8 s: the kernel's centred form); codes packed two per byte by
  `torch._convert_weight_to_int4pack_for_cpu`, matmul `torch._weight_int4pack_mm_for_cpu`. The kernel
  needs the output width to be a multiple of 16 and `group_size` to divide the input width; a layer
  that does not fit is stored as int8 instead (a tiny vocabulary head, say).
Why not torchao: its CPU weight-only configs lower to these same aten kernels, and int8 weight-only
through it measured no faster than fp32 on this machine (0.94x); calling the kernels directly keeps
the engine free of one more dependency and lets tensor-parallel shards be quantized as plain tensors.
On CUDA, int8 layers dequantize per call (correct, not fast) and int4 layers refuse to run.

Which layers: every q/k/v/o and MLP projection, and the output head unless it is tied to the
embedding. Layers a compressed model was cleaned into (`engine/compression/quantized.py`) already hold
integer codes and are left as they are.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from deepfleet.engine.inference.decoder import Decoder

INT4_GROUPS = (32, 64, 128, 256)
PROJECTIONS = ("q", "k", "v", "o", "up", "down", "gate")


class Int8Linear(nn.Module):
    """y = x @ (q * s).T + b with q int8 (out, in) and s (out,) in the compute dtype."""

    bits = 8

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        self.register_buffer("weight", torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scale.to(linear.weight.dtype))
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def dequantize(self) -> Tensor:
        return self.weight.float() * self.scales.float()[:, None]

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.is_cuda:
            y = flat @ self.dequantize().to(x.dtype).t()
        else:
            y = torch._weight_int8pack_mm(flat, self.weight, self.scales.to(x.dtype))
        y = y.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """Group-wise asymmetric int4 weights packed for PyTorch's CPU int4 matmul (module docstring)."""

    bits = 4

    def __init__(self, linear: nn.Linear, *, group_size: int) -> None:
        super().__init__()
        out_f, in_f = linear.weight.shape
        w = linear.weight.detach().float().reshape(out_f, in_f // group_size, group_size)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        codes = torch.round((w - lo) / scale).clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
        self.register_buffer("weight", torch._convert_weight_to_int4pack_for_cpu(codes, 2))
        # (groups, out, 2): the kernel's scale and centred zero per group
        zeros = lo + 8 * scale
        self.register_buffer("scales_and_zeros", torch.stack([scale.squeeze(-1).t(), zeros.squeeze(-1).t()], -1).contiguous())
        self.group_size = group_size
        self.bias = linear.bias
        self.in_features, self.out_features = in_f, out_f
        self.compute_dtype = linear.weight.dtype

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.is_cuda:
            raise NotImplementedError("int4 weights: the CPU int4 kernel cannot run on CUDA; quantize to 8 bits there")
        y = torch._weight_int4pack_mm_for_cpu(flat, self.weight, self.group_size, self.scales_and_zeros.to(x.dtype))
        y = y.reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def _int4_group(linear: nn.Linear, group_size: int) -> int | None:
    """The group size int4 can use for this layer, or None when the layer must stay int8."""
    out_f, in_f = linear.weight.shape
    if out_f % 16:
        return None
    for g in sorted((g for g in INT4_GROUPS if g <= group_size), reverse=True):
        if in_f % g == 0:
            return g
    return None


def quantize_linear(linear: nn.Linear, *, bits: int, group_size: int = 64) -> nn.Module:
    if bits == 4:
        g = _int4_group(linear, group_size)
        if g is not None:
            return Int4Linear(linear, group_size=g)
    return Int8Linear(linear)


@torch.no_grad()
def quantize_decoder(decoder: Decoder, *, bits: int, group_size: int = 64) -> Decoder:
    """Replace the decoder's nn.Linear projections in place (see the module docstring)."""
    if bits not in (4, 8):
        raise ValueError(f"quant.weight.num_bits: {bits} is not supported; use 8 or 4")
    if group_size not in INT4_GROUPS and bits == 4:
        raise ValueError(f"quant.weight.group_size: {group_size} is not supported; use one of {INT4_GROUPS}")
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


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage counted once."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total
