"""Pruning masks: unstructured (L1 / learned top-k), N:M, rows, attention heads and conv channels.

Called by `layers.py` while training (the forward multiplies weights by these masks) and by
`export.py` (the same masks decide which rows/heads/channels are physically removed). Every mask is
1.0 where kept and 0.0 where pruned, shaped to broadcast against the weight. The top-k rule is
DeepSpeed's: keep the ceil(ratio * n) largest scores. A learned mask (`topk_mask` on a score
parameter) passes its gradient straight through to the scores.

Shapes: a linear weight is (out, in); a conv weight (out, in, kh, kw); `heads` splits the input
dimension of an attention output projection into (heads, head_dim) blocks.
"""

from __future__ import annotations

import math

import torch


def topk_mask(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """1.0 at the ceil(ratio * numel) largest entries of `scores`, else 0.0; same shape.
    The gradient with respect to `scores` is the identity (straight-through)."""
    flat = scores.detach().flatten()
    keep = min(max(math.ceil(ratio * flat.numel()), 0), flat.numel())
    mask = torch.zeros_like(flat)
    mask[torch.topk(flat, keep, sorted=False).indices] = 1.0
    mask = mask.view_as(scores)
    if scores.requires_grad:
        return mask + (scores - scores.detach())
    return mask


def l1_mask(weight: torch.Tensor, ratio: float) -> torch.Tensor:
    """Unstructured magnitude mask: keep the ceil(ratio * numel) largest |w|."""
    return topk_mask(weight.detach().abs(), ratio)


def nm_mask(weight: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """N:M mask: in every M consecutive inputs of each output row, keep the N largest |w|.
    The flattened input dimension (in * kh * kw for a conv) must be divisible by M."""
    rows = weight.detach().reshape(weight.shape[0], -1)  # (out, inputs)
    if rows.shape[1] % m:
        raise ValueError(f"block_pattern {n}:{m}: {rows.shape[1]} inputs per row is not divisible by {m}")
    blocks = rows.abs().reshape(rows.shape[0], -1, m)  # (out, inputs / m, m)
    mask = torch.zeros_like(blocks)
    mask.scatter_(2, torch.topk(blocks, n, dim=2, sorted=False).indices, 1.0)
    return mask.reshape(weight.shape)


def ramped_ratio(step: int, *, dense_ratio: float, offset: int, end: int, stride: int) -> float:
    """Dense ratio of a gradual sparse-pruning schedule at `step` (>= offset): linear from 1.0 at
    `offset` to `dense_ratio` at `end`, updated every `stride` steps; `dense_ratio` when end == offset."""
    if end <= offset:
        return dense_ratio
    done = min(((step - offset) // stride) * stride, end - offset) / (end - offset)
    return 1.0 - (1.0 - dense_ratio) * done


def row_scores_l1(weight: torch.Tensor) -> torch.Tensor:
    """L1 norm of each output row (or conv filter): (out, 1) for a linear, (out, 1, 1, 1) for a conv."""
    w = weight.detach()
    return w.abs().reshape(w.shape[0], -1).sum(dim=1).reshape(w.shape[0], *([1] * (w.dim() - 1)))


def head_scores_l1(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """L1 norm of each head's input columns of an output projection (out, heads * head_dim): (1, heads)."""
    w = weight.detach()
    return w.abs().reshape(w.shape[0], heads, -1).sum(dim=(0, 2)).reshape(1, heads)


def head_columns(head_mask: torch.Tensor, in_features: int) -> torch.Tensor:
    """Expand a (1, heads) head mask to the (1, in_features) column mask of the output projection."""
    heads = head_mask.shape[-1]
    return head_mask.reshape(heads, 1).expand(heads, in_features // heads).reshape(1, in_features)
