"""Ring attention: sequence-parallel attention for any head count (when heads do not split over ranks).

Callers: user models (`ring_attention(q, k, v, group=...)`), as the fallback of Ulysses
(engine/attention/ulysses.py) when the heads, or the key/value heads, do not divide over the `sp` ranks.

Each of the p ranks keeps its contiguous 1/p of the queries and passes its key/value shard around the
ring p - 1 times (an all-to-all through engine/comm.py whose only non-empty split goes to the next rank:
gloo has no batched send/receive, and this keeps every collective in comm). Every step attends the local
queries to the visiting shard, giving (out_j, lse_j); the results merge exactly by log-sum-exp weights:
out = sum_j exp(lse_j - lse) out_j with lse = logsumexp_j lse_j. With `causal`, shards from later ranks
are skipped (but still take part in the backward pass's collectives) and the own shard is causally
masked. Autograd flows through the ring (the pass's backward
sends gradients the other way round), so forward and backward equal single-process attention; each step's
score tile (S/p x S/p) is kept for backward, so memory is S^2 / p per rank, not S^2.

Shapes: q (B, S/p, H, D), k and v (B, S/p, Hkv, D) with H a multiple of Hkv (GQA) -> (B, S/p, H, D).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from deepfleet.engine import comm


def _ring_send(x: Tensor, group, *, shift: int) -> Tensor:
    """Send x to the rank `shift` places ahead on the ring, receive the one from `shift` places behind."""
    p, r = comm.get_world_size(group), comm.get_rank(group)
    x = x.contiguous()
    n = x.numel()
    send_sizes = [n if j == (r + shift) % p else 0 for j in range(p)]
    recv_sizes = [n if j == (r - shift) % p else 0 for j in range(p)]
    out = torch.empty_like(x)
    comm.all_to_all_single(out.view(-1), x.view(-1), output_split_sizes=recv_sizes,
                           input_split_sizes=send_sizes, group=group, log_name="ring_attention_pass")
    return out


class _RingPass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        return _ring_send(x, group, shift=1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _ring_send(grad, ctx.group, shift=-1), None


def _attend(q: Tensor, k: Tensor, v: Tensor, *, scale: float, diag_causal: bool) -> tuple[Tensor, Tensor]:
    """q (B, H, s, D) against k, v (B, H, s, D): (out (B, H, s, D), lse (B, H, s)); differentiable."""
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 math (float64 stays float64)
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale  # (B, H, s, s)
    if diag_causal:
        s = scores.shape[-1]
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ v.to(acc)
    return out, lse


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, group=None, causal: bool = False,
                   scale: float | None = None) -> Tensor:
    """Exact attention over the whole sequence from contiguous sequence shards (see the module docstring)."""
    p, rank = comm.get_world_size(group), comm.get_rank(group)
    heads, kv_heads = q.shape[2], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh = q.transpose(1, 2)  # (B, H, S/p, D)
    kv = torch.stack([k, v])  # (2, B, S/p, Hkv, D): one pass moves both
    outs, lses, skipped = [], [], []
    for step in range(p):
        src = (rank - step) % p  # whose shard is visiting
        if causal and src > rank:
            skipped.append(kv)  # all future: not attended
        else:
            kh, vh = (t.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1) for t in kv.unbind(0))
            out, lse = _attend(qh, kh, vh, scale=scale, diag_causal=causal and src == rank)
            outs.append(out)
            lses.append(lse)
        if step < p - 1:
            kv = _RingPass.apply(kv, group)
    lse_all = torch.stack(lses)  # (n, B, H, S/p)
    total = torch.logsumexp(lse_all, dim=0)
    weights = torch.exp(lse_all - total).unsqueeze(-1)  # (n, B, H, S/p, 1)
    merged = (weights * torch.stack(outs)).sum(0).to(q.dtype)
    # Every rank must run every pass's backward (it is a collective): a zero-weighted use of the skipped shards
    # keeps the ranks' backward graphs alike.
    for kv_unused in skipped:
        merged = merged + 0 * kv_unused.sum()
    return merged.transpose(1, 2)  # (B, S/p, H, D)
