"""Ulysses sequence parallelism: all-to-all from sequence shards to head shards around any attention.

Callers: user models (DeepSpeed's `DistributedAttention(local_attention, sequence_process_group)`, or
`ulysses_attention(q, k, v, attn, group=...)`), with the group from `engine.parallel.submesh("sp")`; the
engine averages gradients over the data- and sequence-parallel ranks together (`ParallelDims.grad_group`)
and `SequenceParallelLoader` (engine/attention/data.py) hands each rank its shard of every sequence.

Each of the p ranks holds a contiguous 1/p of the sequence for all heads; one all-to-all per tensor turns
that into the whole sequence for 1/p of the heads, the unchanged attention runs locally (dense SDPA,
block-sparse, anything that sees whole sequences), and one all-to-all turns the output back. The
backward pass of an all-to-all is the opposite all-to-all (a hand-written `autograd.Function`, as torch's
functional all-to-all with autograd is private). GQA: key/value heads that p divides are split like query
heads; fewer key/value heads than ranks (p a multiple of them) are repeated to p heads first, so every
rank gets the one key/value head its query heads use (the repeat's backward sums the copies). Heads that
do not split over p ranks need ring attention (engine/attention/ring.py) instead. The all-to-alls go
through engine/comm.py in the tensors' dtype, or in `comm_dtype` ("fp16"/"bf16" halve the bytes of fp32
activations; DeepSpeed's config key of a similar name sets the gradient reduction's dtype instead).

Shapes: local (batch, seq / p, heads, head_dim) <-> gathered (batch, seq, heads / p, head_dim).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from deepfleet.engine import comm

COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _exchange(x: Tensor, group) -> Tensor:
    """all_to_all_single over dim 0 of x (p, ...) -> (p, ...): chunk i goes to rank i."""
    x = x.contiguous()  # before empty_like, which would copy a permuted layout's strides
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x, group=group, log_name="ulysses_all_to_all")
    return out


def _seq_to_heads(x: Tensor, group, dtype: torch.dtype | None) -> Tensor:
    b, s_local, h, d = x.shape
    p = comm.get_world_size(group)
    send = x.to(dtype or x.dtype).reshape(b, s_local, p, h // p, d).permute(2, 0, 1, 3, 4)  # (p, B, S/p, H/p, D)
    recv = _exchange(send, group)  # chunk i: rank i's sequence shard of my heads
    return recv.permute(1, 0, 2, 3, 4).reshape(b, p * s_local, h // p, d).to(x.dtype)


def _heads_to_seq(x: Tensor, group, dtype: torch.dtype | None) -> Tensor:
    b, s, h_local, d = x.shape
    p = comm.get_world_size(group)
    send = x.to(dtype or x.dtype).reshape(b, p, s // p, h_local, d).permute(1, 0, 2, 3, 4)  # (p, B, S/p, H/p, D)
    recv = _exchange(send, group)  # chunk j: rank j's heads of my sequence shard
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // p, p * h_local, d).to(x.dtype)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, dtype) -> Tensor:
        ctx.group, ctx.dtype = group, dtype
        return _seq_to_heads(x, group, dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _heads_to_seq(grad.contiguous(), ctx.group, ctx.dtype), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, dtype) -> Tensor:
        ctx.group, ctx.dtype = group, dtype
        return _heads_to_seq(x, group, dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _seq_to_heads(grad.contiguous(), ctx.group, ctx.dtype), None, None


def seq_to_heads(x: Tensor, *, group=None, comm_dtype: str | None = None) -> Tensor:
    """(B, S/p, H, D) sequence shard -> (B, S, H/p, D) head shard; differentiable. H must divide by p."""
    p = comm.get_world_size(group)
    if x.shape[2] % p:
        raise ValueError(f"{x.shape[2]} heads do not split over {p} sequence-parallel ranks; use ring attention")
    return _SeqToHeads.apply(x, group, COMM_DTYPES.get(comm_dtype)) if p > 1 else x


def heads_to_seq(x: Tensor, *, group=None, comm_dtype: str | None = None) -> Tensor:
    """(B, S, H/p, D) head shard -> (B, S/p, H, D) sequence shard; differentiable."""
    p = comm.get_world_size(group)
    return _HeadsToSeq.apply(x, group, COMM_DTYPES.get(comm_dtype)) if p > 1 else x


def _kv_to_heads(x: Tensor, *, group, comm_dtype: str) -> Tensor:
    p, kv_heads = comm.get_world_size(group), x.shape[2]
    if kv_heads % p == 0:
        return seq_to_heads(x, group=group, comm_dtype=comm_dtype)
    if p % kv_heads:
        raise ValueError(f"{kv_heads} key/value heads neither split over nor divide {p} sequence-parallel ranks; "
                         "use ring attention")
    return seq_to_heads(x.repeat_interleave(p // kv_heads, dim=2), group=group, comm_dtype=comm_dtype)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, attn: Callable[[Tensor, Tensor, Tensor], Tensor], *,
                      group=None, comm_dtype: str | None = None) -> Tensor:
    """Attention over the whole sequence from sequence shards. q (B, S/p, H, D), k and v (B, S/p, Hkv, D);
    `attn(q, k, v)` gets (B, H/p, S, D) queries and (B, Hkv', S, D) keys/values (Hkv' = max(Hkv/p, 1)) and
    returns (B, H/p, S, D). Returns (B, S/p, H, D)."""
    qh = seq_to_heads(q, group=group, comm_dtype=comm_dtype).transpose(1, 2)
    kh = _kv_to_heads(k, group=group, comm_dtype=comm_dtype).transpose(1, 2)
    vh = _kv_to_heads(v, group=group, comm_dtype=comm_dtype).transpose(1, 2)
    out = attn(qh, kh, vh)  # (B, H/p, S, D)
    return heads_to_seq(out.transpose(1, 2).contiguous(), group=group, comm_dtype=comm_dtype)


class DistributedAttention(nn.Module):
    """DeepSpeed's Ulysses wrapper: `local_attention(q, k, v, *args, **kwargs)` sees whole sequences of
    a head shard, in the caller's layout. scatter_idx is the heads dimension (2), gather_idx the sequence
    dimension: 0 for (seq, batch, heads, dim) tensors, 1 for (batch, seq, heads, dim)."""

    def __init__(self, local_attention: Callable[..., Tensor], sequence_process_group, scatter_idx: int = 2,
                 gather_idx: int = 0, *, comm_dtype: str | None = None) -> None:
        super().__init__()
        if scatter_idx != 2 or gather_idx not in (0, 1):
            raise ValueError(f"scatter_idx={scatter_idx}, gather_idx={gather_idx}: heads must be dim 2 and the "
                             "sequence dim 0 or 1")
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.comm_dtype = comm_dtype

    def forward(self, query: Tensor, key: Tensor, value: Tensor, *args, **kwargs) -> Tensor:
        seq_first = self.gather_idx == 0

        def gather(t: Tensor, *, kv: bool) -> Tensor:  # caller's layout -> (B, S, h, D) -> caller's layout
            t = t.transpose(0, 1) if seq_first else t
            move = _kv_to_heads if kv else seq_to_heads
            t = move(t, group=self.spg, comm_dtype=self.comm_dtype)
            return t.transpose(0, 1) if seq_first else t

        q, k, v = gather(query, kv=False), gather(key, kv=True), gather(value, kv=True)
        out = self.local_attn(q, k, v, *args, **kwargs)
        out = out.transpose(0, 1) if seq_first else out
        out = heads_to_seq(out.contiguous(), group=self.spg, comm_dtype=self.comm_dtype)
        return out.transpose(0, 1) if seq_first else out
