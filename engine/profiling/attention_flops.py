"""Honest FLOP formulas for scaled-dot-product attention, added to `torch.utils.flop_counter`'s table.

Used by `deepfleet.engine.profiling.counter` (every FLOP count the engine makes goes through it).
Why these exist beside torch's own: torch's table (torch 2.13) has no entry for the CPU kernel
(`_scaled_dot_product_flash_attention_for_cpu` and its backward count 0 FLOPs), and its entries for the
CUDA kernels count the full (L, S) score matrix whatever `is_causal` or the mask says, so causal
attention is counted twice the work it does and MFU on a causal model can pass 100%.

Counting convention (torch's): one multiply-add is 2 FLOPs. Forward: scores = Q K^T and out = P V, each
2 * d FLOPs per kept score, so 4 * d * kept (d = the head dim; V's width for the second matmul).
Backward: dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q, four matmuls over the kept scores, 8 * d *
kept. `kept` is the number of (query, key) pairs the mask lets through, summed over batch and heads:
- `is_causal`: torch's causal mask is the lower triangle aligned to the top-left corner of the (L, S)
  score matrix, so row i keeps min(i + 1, S) keys;
- a boolean mask keeps its True entries, an additive float mask its entries above -inf (broadcast over
  batch and heads as torch broadcasts it);
- otherwise every pair, L * S.
Softmax, scaling and the mask itself are not counted (they are not matmul FLOPs, as in torch's table).
The recomputation of P inside a fused backward is hardware work, not model work, and is not counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

aten = torch.ops.aten


def causal_pairs(q_len: int, k_len: int) -> int:
    """Kept (query, key) pairs of one (q_len, k_len) causal score matrix: sum over i of min(i + 1, k_len)."""
    full_rows = max(0, q_len - k_len)  # rows past the diagonal's end keep every key
    tri = min(q_len, k_len)
    return tri * (tri + 1) // 2 + full_rows * k_len


def kept_pairs(query: torch.Tensor, key: torch.Tensor, *, is_causal: bool, mask: torch.Tensor | None) -> int:
    """(query, key) pairs that attention computes, summed over batch and heads.

    query: (..., L, d), key: (..., S, d); mask broadcastable to (..., L, S)."""
    *lead, q_len, _ = query.shape
    k_len = key.shape[-2]
    groups = 1
    for n in lead:
        groups *= n
    if is_causal:
        return groups * causal_pairs(q_len, k_len)
    if mask is not None:
        keep = mask if mask.dtype == torch.bool else mask > float("-inf")
        full = torch.broadcast_shapes(keep.shape, (*lead, q_len, k_len))
        total = 1
        for n in full:
            total *= n
        # the mean over the mask's own elements equals the mean over its broadcast
        return round(float(keep.float().mean()) * total) if keep.numel() else 0
    return groups * q_len * k_len


def _bind(op: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [a.name for a in op.default._schema.arguments]
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


def _formula(op: Any, *, backward: bool) -> Callable[..., int]:
    """A raw-argument formula for `op` (it reads the tensors, not just their shapes, to see the mask)."""

    def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        a = _bind(op, args, kwargs)
        query, key, value = a["query"], a["key"], a["value"]
        mask = a.get("attn_mask", a.get("attn_bias"))
        kept = kept_pairs(query, key, is_causal=bool(a.get("is_causal", False)), mask=mask)
        d_qk, d_v = query.shape[-1], value.shape[-1]
        per_pair = 2 * (d_qk + d_v)  # Q K^T and P V
        return kept * (2 * per_pair if backward else per_pair)

    count._get_raw = True  # FlopCounterMode passes raw arguments to formulas marked raw
    return count


# (forward op, backward op) pairs of the fused SDPA kernels torch dispatches to.
_SDPA_OPS = (
    ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"),
    ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"),
    ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"),
    ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"),
)


def attention_formulas() -> dict[Any, Callable[..., int]]:
    """`custom_mapping` for FlopCounterMode: every fused SDPA op this torch build has -> its formula."""
    table: dict[Any, Callable[..., int]] = {}
    for fwd, bwd in _SDPA_OPS:
        for name, backward in ((fwd, False), (bwd, True)):
            op = getattr(aten, name, None)
            if op is not None:
                table[op] = _formula(op, backward=backward)
    return table
