"""The decoder's attention in its three forms, and the packed layout of a prefill.

Called by `decoder.Layer.forward`, which writes the KV cache and picks the form:
- `masked_attention`: SDPA with an explicit visibility mask (per-row positions, padding). It serves
  `InferenceEngine.forward` (no cache) and the eager decode step (keys read back from the cache).
- `packed_attention`: a prefill whose prompts are laid end to end (`Packed`), so the projections,
  norms and MLP run on the real tokens only, not on the padding a batch of mixed lengths needs (on
  benchmarks/inference.py's batch of 16 prompts, 392 tokens instead of 512). Only the attention itself
  runs padded: the queries are scattered into (prompts, width) rows, which are right-aligned at
  position 0, so SDPA's plain causal mask is the right one, and the keys are the rows the layer has
  just written into the cache.
- `decode_attention`: one query per row against the cache, as multiply-and-sum reductions instead of
  SDPA. Under inductor (the compiled static step, `compiled.py`) it becomes two fused loops with the
  mask and softmax inside, where the SDPA call was one opaque kernel per layer that cost about 1.5x
  as much on the batch-16 decode step of benchmarks/inference.py (eager it is slower: it materializes
  the products, so the eager path keeps SDPA).

Shapes: q (batch, seq, heads, head_dim); a layer's cache (slots, kv_heads, max_tokens, head_dim);
keys and values handed in (batch, kv_heads, keys, head_dim), a view of the cache rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Packed:
    """Where a prefill's prompts sit: tokens are laid end to end in one (1, tokens) sequence."""

    slots: Tensor  # (prompts,) the cache row of each prompt
    token_slots: Tensor  # (1, tokens) the cache row of each token
    index: Tensor  # (tokens,) each token's place in the (prompts * width) right-padded layout
    last: Tensor  # (prompts,) each prompt's last token in the packed sequence
    width: int  # the longest prompt

    @classmethod
    def of(cls, lengths: list[int], slots: list[int], *, device: torch.device) -> Packed:
        """The layout of prompts of `lengths` tokens going into cache rows `slots`."""
        width = max(lengths)
        token_slots = [s for s, n in zip(slots, lengths, strict=True) for _ in range(n)]
        index = [i * width + p for i, n in enumerate(lengths) for p in range(n)]
        last = torch.tensor(lengths, device=device).cumsum(0) - 1
        return cls(slots=torch.tensor(slots, device=device), token_slots=torch.tensor([token_slots], device=device),
                   index=torch.tensor(index, device=device), last=last, width=width)


def _repeat_kv(keys: Tensor, values: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """Grouped-query attention: each of the kv heads serves heads // kv_heads query heads."""
    if keys.shape[1] == heads:
        return keys, values
    rep = heads // keys.shape[1]
    return keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)


def masked_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """q (batch, seq, heads, head_dim), keys/values (batch, kv_heads, keys, head_dim), mask broadcastable
    to (batch, 1, seq, keys) (True: visible) -> (batch, seq, heads * head_dim)."""
    b, t, h, _ = q.shape
    q = q.transpose(1, 2)
    keys, values = _repeat_kv(keys, values, h)
    att = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask)
    return att.transpose(1, 2).reshape(b, t, -1)


def packed_attention(q: Tensor, ck: Tensor, cv: Tensor, packed: Packed) -> Tensor:
    """q (1, tokens, heads, head_dim) of a packed prefill whose keys and values are already in the
    cache (ck, cv) -> (1, tokens, heads * head_dim)."""
    _, n_tokens, h, d = q.shape
    n, w = packed.slots.shape[0], packed.width
    padded = q.new_zeros(n * w, h, d)
    padded[packed.index] = q[0]
    q = padded.view(n, w, h, d).transpose(1, 2)  # (prompts, heads, width, head_dim)
    # The prompts' rows up to the width, gathered (a copy of only what attention reads; in whichever
    # slots the prompts sit, so a compiled prefill needs no variant for rows in order).
    keys, values = (c[packed.slots, :, :w] for c in (ck, cv))
    keys, values = _repeat_kv(keys, values, h)
    # Every prompt starts at position 0 of its row, so query j sees keys 0..j: the plain causal mask.
    # Padded queries (past a prompt's end) see stale keys and are dropped below.
    att = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), is_causal=True)
    return att.transpose(1, 2).reshape(n * w, h * d)[packed.index].view(1, n_tokens, h * d)


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, positions: Tensor) -> Tensor:
    """q (batch, 1, heads, head_dim) at `positions` (batch, 1); keys/values (batch, kv_heads, span,
    head_dim) -> (batch, 1, heads * head_dim). Math in fp32, as SDPA's CPU kernels accumulate."""
    b, _, h, d = q.shape
    kv_heads, span = keys.shape[1], keys.shape[2]
    qf = q.float().view(b, kv_heads, h // kv_heads, 1, d)  # a kv head's query heads side by side
    scores = (qf * keys.float()[:, :, None]).sum(-1) * d ** -0.5  # (batch, kv_heads, rep, span)
    visible = torch.arange(span, device=q.device) <= positions[:, :, None, None]  # (batch, 1, 1, span)
    p = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    out = (p[..., None] * values.float()[:, :, None]).sum(-2)  # (batch, kv_heads, rep, head_dim)
    return out.to(q.dtype).view(b, 1, h * d)


def cache_rows(cache: Tensor, slots: Tensor) -> Tensor:
    """The cache rows of `slots`: a view when they are 0..n-1 in order (the common case), else a copy."""
    n = slots.shape[0]
    if n <= cache.shape[0] and bool((slots == torch.arange(n, device=slots.device)).all()):
        return cache[:n]
    return cache[slots]
