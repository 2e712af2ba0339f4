"""`redundancy_clean`'s work: fold a trained compressed model into a smaller plain model, in place.

Called by `compress.redundancy_clean`. Three passes over the layers `init_compression` prepared:
1. fold: each layer's effective weight at the current step (masks applied, weights on their
   quantization grid) and, when weights are quantized, that grid as per-row (rows, blocks) scales;
2. shrink: for row/head/channel pruning groups with `related_modules`, the pruned rows (or heads'
   input columns) are removed from the layer and the matching inputs (or head rows) from the related
   layers, paired by match order as DeepSpeed does; without related modules pruned rows stay zeros;
3. replace: plain nn.Linear/Conv2d/Embedding, or the integer-storage layers of `quantized.py`.
The nearest module above the related Q/K/V layers that owns a head count (`n_heads`, `num_heads`, `num_attention_heads`, `n_head`)
get the kept count. The codes are recovered exactly from the folded weight when the training grid
lines up with rows (one group, or groups of whole rows, or equal slices of each row) and no column
of a multi-block row was removed; otherwise the layer is re-quantized per row from its folded weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepfleet.engine.compression.compress import MARKER, _unwrap, technique_targets
from deepfleet.engine.compression.layers import CompressedMixin
from deepfleet.engine.compression.masks import head_columns
from deepfleet.engine.compression.quantized import (
    QuantizedConv2d,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedWeight,
)
from deepfleet.engine.compression.quantizers import _grid, quantize_codes
from deepfleet.engine.config_compression import CompressionConfig

HEAD_COUNT_ATTRS = ("n_heads", "num_heads", "num_attention_heads", "n_head")


@dataclass
class Folded:
    """One layer while cleaning: weight (rows, ...) and bias as the trained forward uses them."""

    module: nn.Module
    weight: torch.Tensor
    bias: torch.Tensor | None
    bits: int | None = None  # weight quantization bits, None when not quantized
    symmetric: bool = True
    scale: torch.Tensor | None = None  # (rows, blocks) grid; None: re-derive per row at the end
    zero: torch.Tensor | None = None
    act: dict | None = None
    act_range: torch.Tensor | None = None
    row_keep: torch.Tensor | None = None  # bool (rows,) from row/channel pruning
    head_keep: torch.Tensor | None = None  # bool (heads,) from head pruning


@torch.no_grad()
def _fold(layer: nn.Module) -> Folded:
    if not isinstance(layer, CompressedMixin):
        return Folded(layer, layer.weight.detach().clone(), None if getattr(layer, "bias", None) is None
                      else layer.bias.detach().clone())
    was_training = layer.training
    layer.eval()
    w, b = layer.compressed_weight()
    f = Folded(layer, w.detach().clone(), None if b is None else b.detach().clone())
    if layer.active("weight_quantization"):
        wq = layer.techniques["weight_quantization"]
        f.bits, f.symmetric = layer.current_bits(), wq["quantization_type"] == "symmetric"
        f.scale, f.zero = _row_grid(layer.weight.detach(), f.bits, groups=wq["quantize_groups"], symmetric=f.symmetric)
    if layer.active("activation_quantization"):
        f.act = dict(layer.techniques["activation_quantization"])
        f.act_range = getattr(layer, "cq_act_range", None)
        f.act_range = None if f.act["range_calibration"] == "dynamic" else f.act_range
    if layer.active("row_pruning") or layer.active("channel_pruning"):
        f.row_keep = layer.row_mask().detach().reshape(-1) > 0
    if layer.active("head_pruning"):
        f.head_keep = layer.head_mask().detach().reshape(-1) > 0
    layer.train(was_training)
    return f


def _row_grid(w: torch.Tensor, bits: int, *, groups: int, symmetric: bool) -> tuple[torch.Tensor | None, ...]:
    """The training grid as (rows, blocks) scale and zero, or (None, None) if groups straddle rows."""
    rows = w.shape[0]
    _, scale, zero = _grid(w, bits, groups=groups, symmetric=symmetric)  # (groups, 1)
    if groups <= rows and rows % groups == 0:  # each group is rows // groups whole rows
        return scale.repeat_interleave(rows // groups, 0), zero.repeat_interleave(rows // groups, 0)
    if groups % rows == 0:  # each row is groups // rows equal slices
        return scale.reshape(rows, -1), zero.reshape(rows, -1)
    return None, None


def _take_rows(f: Folded, keep: torch.Tensor) -> None:
    f.weight = f.weight[keep]
    f.bias = None if f.bias is None else f.bias[keep]
    if f.scale is not None:
        f.scale, f.zero = f.scale[keep], f.zero[keep]


def _take_cols(f: Folded, keep: torch.Tensor) -> None:
    f.weight = f.weight[:, keep]
    if f.scale is not None and f.scale.shape[1] > 1:
        f.scale = f.zero = None  # blocks of a row no longer line up


def _head_rows(f: Folded, head_keep: torch.Tensor, o_inputs: int) -> torch.Tensor:
    """Row mask of a related QKV layer: its rows are chunks of (heads, head_dim), one chunk per
    projection fused into it (out = chunks * o_inputs)."""
    rows = f.weight.shape[0]
    if rows % o_inputs:
        raise ValueError(f"head_pruning related module: {rows} outputs is not a multiple of the output "
                         f"projection's {o_inputs} inputs; relate only the Q/K/V projections")
    cols = head_columns(head_keep.float().reshape(1, -1), o_inputs).reshape(-1) > 0
    return cols.repeat(rows // o_inputs)


def _shrink(model: nn.Module, cfg: CompressionConfig, folded: dict[str, Folded]) -> None:
    for item in technique_targets(model, cfg):
        if item["related"] is None or item["technique"] not in ("row_pruning", "head_pruning", "channel_pruning"):
            continue
        for names, related in zip(item["modules"], item["related"], strict=True):
            for j, name in enumerate(names):
                f = folded[name]
                partners = [_folded(model, folded, r[j]) for r in related if j < len(r)]
                if item["technique"] == "head_pruning":
                    keep = f.head_keep
                    o_inputs = f.weight.shape[1]
                    _take_cols(f, head_columns(keep.float().reshape(1, -1), o_inputs).reshape(-1) > 0)
                    for p in partners:
                        _take_rows(p, _head_rows(p, keep, o_inputs))
                    # The module that splits heads owns the Q/K/V projections (BERT's self-attention, GPT's block).
                    for owner in {r[j] for r in related if j < len(r)} or {name}:
                        _set_head_count(model, owner, int(keep.sum()))
                else:
                    keep = f.row_keep
                    _take_rows(f, keep)
                    for p in partners:
                        _shrink_inputs(p, keep)


def _folded(model: nn.Module, folded: dict[str, Folded], name: str) -> Folded:
    if name not in folded:
        folded[name] = _fold(model.get_submodule(name))
    return folded[name]


def _shrink_inputs(p: Folded, keep: torch.Tensor) -> None:
    if isinstance(p.module, nn.BatchNorm2d):
        for attr in ("weight", "bias", "running_mean", "running_var"):
            t = getattr(p.module, attr)
            if t is not None:
                t.data = t.data[keep]
        p.module.num_features = int(keep.sum())
    else:
        _take_cols(p, keep)


def _set_head_count(model: nn.Module, name: str, heads: int) -> None:
    parts = name.split(".")
    for depth in range(len(parts) - 1, -1, -1):  # nearest enclosing module that owns a head count
        owner = model.get_submodule(".".join(parts[:depth]))
        for attr in HEAD_COUNT_ATTRS:
            if isinstance(getattr(owner, attr, None), int):
                setattr(owner, attr, heads)
                return


def _codes(f: Folded) -> QuantizedWeight:
    rows = f.weight.shape[0]
    flat = f.weight.reshape(rows, -1)
    if f.scale is None:  # re-derive one scale per row from the folded weight
        codes, scale, zero = quantize_codes(flat, f.bits, groups=rows, symmetric=f.symmetric)
    else:
        scale, zero = f.scale, f.zero
        blocks = scale.shape[1]
        q = (flat.reshape(rows, blocks, -1) - zero.unsqueeze(-1)) / scale.unsqueeze(-1)
        lo, hi = (-(2 ** (f.bits - 1)), 2 ** (f.bits - 1) - 1) if f.symmetric else (0, 2**f.bits - 1)
        codes = torch.round(q).clamp(lo, hi).reshape(rows, -1)
    return QuantizedWeight(codes, scale, zero, bits=f.bits, symmetric=f.symmetric, shape=f.weight.shape)


def _replacement(f: Folded) -> nn.Module:
    m = f.module
    if isinstance(m, nn.BatchNorm2d):
        return m
    if isinstance(m, nn.Embedding):
        if f.bits is not None:
            return QuantizedEmbedding(_codes(f), like=m)
        return nn.Embedding.from_pretrained(f.weight, freeze=False, padding_idx=m.padding_idx)
    if f.bits is None and f.act is None:
        if isinstance(m, nn.Conv2d):
            new = nn.Conv2d(f.weight.shape[1] * m.groups, f.weight.shape[0], m.kernel_size, stride=m.stride,
                            padding=m.padding, dilation=m.dilation, groups=m.groups, bias=f.bias is not None,
                            padding_mode=m.padding_mode, device="meta")
        else:
            new = nn.Linear(f.weight.shape[1], f.weight.shape[0], bias=f.bias is not None, device="meta")
        new.weight = nn.Parameter(f.weight.detach().clone())
        if f.bias is not None:
            new.bias = nn.Parameter(f.bias.detach().clone())
        return new
    weight = _codes(f) if f.bits is not None else f.weight
    if isinstance(m, nn.Conv2d):
        return QuantizedConv2d(weight, f.bias, like=m, act=f.act, act_range=f.act_range)
    return QuantizedLinear(weight, f.bias, act=f.act, act_range=f.act_range)


def clean(model: nn.Module, cfg: CompressionConfig) -> nn.Module:
    """Fold, shrink and replace every compressed layer of `model` (see the module docstring)."""
    target = _unwrap(model)
    folded = {name: _fold(m) for name, m in target.named_modules() if isinstance(m, CompressedMixin)}
    _shrink(target, cfg, folded)
    for name, f in folded.items():
        parent_name, _, child = name.rpartition(".")
        parent = target.get_submodule(parent_name) if parent_name else target
        new = _replacement(f)
        new.train(f.module.training)
        setattr(parent, child, new)
    if hasattr(target, MARKER):
        object.__delattr__(target, MARKER)
    return model


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers (integer codes counted at their storage size)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def nonzero_fraction(model: nn.Module) -> float:
    """Fraction of nonzero weights over the model's float parameters (sparsity achieved by masks)."""
    nz = sum(int((p != 0).sum()) for p in model.parameters())
    return nz / max(sum(p.numel() for p in model.parameters()), 1)

