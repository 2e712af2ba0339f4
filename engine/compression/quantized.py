"""Inference layers holding integer weights: int8 codes (int4 packed two per byte) with per-row scales.

Built by `export.py` (`redundancy_clean`) from a trained compressed layer; plain nn.Modules whose
forward dequantizes the codes and runs the ordinary torch op, so any loader (the inference engine
included) can run or re-kernelize them. Storage: codes (rows, cols) as int8 (symmetric, <= 8 bits),
uint8 (asymmetric, <= 8 bits), or uint8 holding two 4-bit codes (<= 4 bits); `scale`/`zero` are
fp32 (rows, blocks), each block a contiguous equal slice of a row. Activation quantization, when
trained, stays in the forward (dynamic per token, or the calibrated static range).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepfleet.engine.compression.quantizers import fake_quantize, pack_int4, token_groups, unpack_int4


class QuantizedWeight(nn.Module):
    """Integer weight codes with scales; `dequantize()` gives the float weight (shape `shape`)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, *, bits: int,
                 symmetric: bool, shape: torch.Size) -> None:
        super().__init__()
        self.bits, self.symmetric, self.shape = bits, symmetric, tuple(shape)
        rows = codes.shape[0]
        self.packed = bits <= 4 and codes.shape[1] % 2 == 0
        if self.packed:
            offset = 2 ** (bits - 1) if symmetric else 0  # 4-bit codes stored unsigned
            stored = pack_int4((codes + offset).to(torch.uint8))
        elif bits <= 8:
            stored = codes.to(torch.int8 if symmetric else torch.uint8)
        else:
            stored = codes.to(torch.int16 if symmetric else torch.int32)
        self.register_buffer("codes", stored.reshape(rows, -1))
        self.register_buffer("scale", scale.float().reshape(rows, -1))
        self.register_buffer("zero", zero.float().reshape(rows, -1))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes = self.codes
        if self.packed:
            codes = unpack_int4(codes).float() - (2 ** (self.bits - 1) if self.symmetric else 0)
        blocks = self.scale.shape[1]
        q = codes.float().reshape(codes.shape[0], blocks, -1)  # (rows, blocks, cols per block)
        w = q * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)
        return w.reshape(self.shape).to(dtype)

    def storage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


class _ActQuant(nn.Module):
    """The trained activation quantization of an exported layer's input (or none)."""

    def _init_act(self, act: dict | None, act_range: torch.Tensor | None) -> None:
        self.act = act
        if act_range is not None:
            self.register_buffer("act_range", act_range.detach().clone())
        else:
            self.act_range = None

    def quant_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is None:
            return x
        symmetric = self.act["quantization_type"] == "symmetric"
        if self.act_range is None:
            return fake_quantize(x, self.act["bits"], groups=token_groups(x), symmetric=symmetric)
        return fake_quantize(x, self.act["bits"], symmetric=symmetric, min_max=(self.act_range[0], self.act_range[1]))


class QuantizedLinear(_ActQuant):
    """A linear layer whose weight is stored as integer codes (or float, when only inputs are quantized)."""

    def __init__(self, weight: QuantizedWeight | torch.Tensor, bias: torch.Tensor | None, *,
                 act: dict | None = None, act_range: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, QuantizedWeight) else nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.out_features, self.in_features = (weight.shape if isinstance(weight, QuantizedWeight) else weight.shape)[:2]
        self._init_act(act, act_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.dequantize(x.dtype) if isinstance(self.weight, QuantizedWeight) else self.weight
        return F.linear(self.quant_input(x), w, self.bias)


class QuantizedConv2d(_ActQuant):
    """A Conv2d whose weight is stored as integer codes; convolution settings copied from the original."""

    def __init__(self, weight: QuantizedWeight | torch.Tensor, bias: torch.Tensor | None, *, like: nn.Conv2d,
                 act: dict | None = None, act_range: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, QuantizedWeight) else nn.Parameter(weight.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.stride, self.padding, self.dilation, self.groups = like.stride, like.padding, like.dilation, like.groups
        self._init_act(act, act_range)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.dequantize(x.dtype) if isinstance(self.weight, QuantizedWeight) else self.weight
        return F.conv2d(self.quant_input(x), w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class QuantizedEmbedding(nn.Module):
    """An embedding table stored as integer codes, one scale per token."""

    def __init__(self, weight: QuantizedWeight, *, like: nn.Embedding) -> None:
        super().__init__()
        self.weight = weight
        self.padding_idx = like.padding_idx
        self.num_embeddings, self.embedding_dim = like.num_embeddings, like.embedding_dim

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx, self.weight.dequantize(), self.padding_idx)
