"""Block-sparse attention that computes only a layout's non-zero blocks, forward and backward.

Called by `deepfleet.engine.attention.sparse_self_attention` (DeepSpeed's `SparseSelfAttention`) and by
the sequence-parallel attention when it runs a sparse layout. The tile-wise pure-torch functions here
(`forward_reference`, `backward_reference`) are the specification; `deepfleet::block_sparse_attention`
and its `_backward` op dispatch to `kernels/_triton/block_sparse_attention.py` on the GPU (see
`_dispatch`) and otherwise to the row-batched CPU path in `block_sparse_rows.py`, which tests compare
against the specification.

Why hand-written: torch's `flex_attention` has no backward on CPU (2.13), and a dense masked softmax
costs memory quadratic in the sequence. This one gathers, for each non-zero block (h, r, c) of the
layout, query block r and key/value block c, and works on those `nnz` tiles only: memory and work are
linear in the number of non-zero blocks. The softmax of a query row spans all its blocks, so the row
max and sum are segment reductions over the tiles of one block row (`index_reduce_`/`index_add_`);
the backward pass recomputes the probabilities from the saved log-sum-exp (FlashAttention's scheme), so
nothing of size nnz * block * block is kept between forward and backward.

Shapes (legend: B batch, H heads, S = nb * blk tokens, D head dim, R = H * nb block rows, N = nnz):
  q, k, v (B, H, S, D); rows, cols (N,) int64 indices into the R flattened block rows of q and of k/v
  (row id = h * nb + r, column id = h * nb + c; `layout_blocks` builds them from a layout, sorted by row);
  bias (1 or B, N, blk, blk) additive (fp32, -inf masks; a constant: no gradient flows to it);
  out (B, H, S, D) in q's dtype; lse (B, H, S) fp32, float64 for float64 inputs (-inf for a query that sees no key).
`causal=True` also masks every key position after the query's (inside diagonal blocks, and whole blocks
above the diagonal). Math is fp32 (float64 stays float64).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from deepfleet.kernels import block_sparse_rows
from deepfleet.kernels._dispatch import triton_module, use_triton


def layout_blocks(layout: Tensor) -> tuple[Tensor, Tensor]:
    """(H, nb, nb) 0/1 layout -> (rows, cols) flat block ids of its non-zero blocks, sorted by (h, r, c)."""
    if layout.dim() != 3 or layout.shape[1] != layout.shape[2]:
        raise ValueError(f"layout shape {tuple(layout.shape)} must be (heads, num_blocks, num_blocks)")
    h, r, c = layout.nonzero(as_tuple=True)
    nb = layout.shape[1]
    return (h * nb + r).contiguous(), (h * nb + c).contiguous()


def expand_layout(layout: Tensor, block: int, *, causal: bool = False) -> Tensor:
    """(H, nb, nb) layout -> (H, S, S) bool mask of the token pairs it lets attend (tests, flex masks)."""
    mask = layout.bool().repeat_interleave(block, 1).repeat_interleave(block, 2)
    if causal:
        mask = mask & torch.ones(mask.shape[1:], dtype=torch.bool, device=mask.device).tril()
    return mask


def _tiles(x: Tensor, block: int) -> Tensor:
    """(B, H, S, D) -> (B, H * nb, blk, D), a view."""
    b, h, s, d = x.shape
    return x.reshape(b, h * (s // block), block, d)


def _scores(q: Tensor, k: Tensor, rows: Tensor, cols: Tensor, bias: Tensor | None, scale: float,
            causal: bool, block: int) -> tuple[Tensor, Tensor]:
    """The scaled, biased, masked scores of every tile (B, N, blk, blk) and the gathered key tiles."""
    acc = torch.promote_types(q.dtype, torch.float32)
    nb = q.shape[2] // block
    qb = _tiles(q, block).index_select(1, rows).to(acc)  # (B, N, blk, D)
    kb = _tiles(k, block).index_select(1, cols).to(acc)
    s = qb @ kb.transpose(-1, -2) * scale  # (B, N, blk, blk)
    if bias is not None:
        s = s + bias.to(acc)
    if causal:
        offs = torch.arange(block, device=q.device)
        qpos = (rows % nb)[:, None, None] * block + offs[None, :, None]  # (N, blk, 1)
        kpos = (cols % nb)[:, None, None] * block + offs[None, None, :]  # (N, 1, blk)
        s = s.masked_fill(kpos > qpos, float("-inf"))
    return s, kb


def forward_reference(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, cols: Tensor, bias: Tensor | None,
                      scale: float, causal: bool, block: int) -> tuple[Tensor, Tensor]:
    """The specification of the forward pass: (out, lse)."""
    b, h, s_len, d = q.shape
    n_rows = h * (s_len // block)
    s, _ = _scores(q, k, rows, cols, bias, scale, causal, block)
    acc = s.dtype
    vb = _tiles(v, block).index_select(1, cols).to(acc)  # (B, N, blk, D)
    m = s.new_full((b, n_rows, block), float("-inf"))
    # row max over all tiles of a block row (scatter_reduce_: index_reduce_ warns that it is in beta)
    m.scatter_reduce_(1, rows.view(1, -1, 1).expand(b, -1, block), s.amax(-1), "amax")
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # rows that see nothing: keep exp() at 0, not NaN
    p = torch.exp(s - m.index_select(1, rows)[..., None])  # (B, N, blk, blk)
    denom = s.new_zeros((b, n_rows, block)).index_add_(1, rows, p.sum(-1))
    out = s.new_zeros((b, n_rows, block, d)).index_add_(1, rows, p @ vb)
    seen = denom > 0
    out = out / torch.where(seen, denom, torch.ones_like(denom))[..., None]
    lse = torch.where(seen, m + torch.log(torch.where(seen, denom, torch.ones_like(denom))), float("-inf"))
    return out.reshape(b, h, s_len, d).to(q.dtype), lse.reshape(b, h, s_len)


def backward_reference(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rows: Tensor,
                       cols: Tensor, bias: Tensor | None, scale: float, causal: bool,
                       block: int) -> tuple[Tensor, Tensor, Tensor]:
    """The specification of the backward pass: (dq, dk, dv), recomputing the probabilities from lse."""
    b, h, s_len, d = q.shape
    n_rows = h * (s_len // block)
    s, kb = _scores(q, k, rows, cols, bias, scale, causal, block)
    acc = s.dtype
    lse_t = lse.to(acc).reshape(b, n_rows, block)
    lse_t = torch.where(torch.isinf(lse_t), torch.full_like(lse_t, float("inf")), lse_t)  # unseen rows: p = 0
    p = torch.exp(s - lse_t.index_select(1, rows)[..., None])  # (B, N, blk, blk)
    do_t = _tiles(dout, block).to(acc)  # (B, R, blk, D)
    dob = do_t.index_select(1, rows)
    qb = _tiles(q, block).index_select(1, rows).to(acc)
    vb = _tiles(v, block).index_select(1, cols).to(acc)
    delta = (do_t * _tiles(out, block).to(acc)).sum(-1)  # (B, R, blk): rowsum(dO * O)
    dp = dob @ vb.transpose(-1, -2)
    ds = p * (dp - delta.index_select(1, rows)[..., None])  # (B, N, blk, blk)
    shape = (b, n_rows, block, d)
    dq = s.new_zeros(shape).index_add_(1, rows, ds @ kb) * scale
    dk = s.new_zeros(shape).index_add_(1, cols, ds.transpose(-1, -2) @ qb) * scale
    dv = s.new_zeros(shape).index_add_(1, cols, p.transpose(-1, -2) @ dob)
    return (dq.reshape(q.shape).to(q.dtype), dk.reshape(k.shape).to(k.dtype), dv.reshape(v.shape).to(v.dtype))


@torch.library.custom_op("deepfleet::block_sparse_attention", mutates_args=())
def block_sparse_attention_op(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, cols: Tensor, bias: Tensor | None,
                              scale: float, causal: bool, block: int) -> tuple[Tensor, Tensor]:
    """Forward: (out, lse)."""
    if use_triton(q, k, v):
        return triton_module("block_sparse_attention").forward(q, k, v, rows, cols, bias, scale, causal, block)
    return block_sparse_rows.forward(q, k, v, rows, cols, bias, scale, causal, block)


@block_sparse_attention_op.register_fake
def _(q, k, v, rows, cols, bias, scale, causal, block):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))


@torch.library.custom_op("deepfleet::block_sparse_attention_backward", mutates_args=())
def block_sparse_attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                       rows: Tensor, cols: Tensor, bias: Tensor | None, scale: float, causal: bool,
                                       block: int) -> tuple[Tensor, Tensor, Tensor]:
    """Backward: (dq, dk, dv)."""
    if use_triton(q, k, v):
        return triton_module("block_sparse_attention").backward(
            dout, q, k, v, out, lse, rows, cols, bias, scale, causal, block
        )
    return block_sparse_rows.backward(dout, q, k, v, out, lse, rows, cols, bias, scale, causal, block)


@block_sparse_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, rows, cols, bias, scale, causal, block):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, rows, cols, bias, ctx.scale, ctx.causal, ctx.block = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, rows, cols, bias)


def _backward(ctx, dout: Tensor, _dlse: Tensor | None):
    q, k, v, out, lse, rows, cols, bias = ctx.saved_tensors
    dq, dk, dv = block_sparse_attention_backward_op(
        dout.contiguous(), q, k, v, out, lse, rows, cols, bias, ctx.scale, ctx.causal, ctx.block
    )
    return dq, dk, dv, None, None, None, None, None, None


block_sparse_attention_op.register_autograd(_backward, setup_context=_setup_context)


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, cols: Tensor, *, block: int,
                           bias: Tensor | None = None, scale: float | None = None, causal: bool = False) -> Tensor:
    """softmax(q k^T * scale + bias) v over the non-zero blocks (rows, cols) only; differentiable in q, k, v.
    q, k, v (B, H, S, D) with S a multiple of `block`; scale defaults to D ** -0.5. Returns (B, H, S, D)."""
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        raise ValueError(f"q, k, v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} must be equal "
                         "(batch, heads, seq, head_dim)")
    if q.shape[2] % block:
        raise ValueError(f"sequence length {q.shape[2]} is not a multiple of block {block}; pad it first")
    if rows.shape != cols.shape or rows.dim() != 1:
        raise ValueError(f"rows {tuple(rows.shape)} and cols {tuple(cols.shape)} must be equal 1-D index tensors")
    n = rows.numel()
    if bias is not None and (bias.dim() != 4 or bias.shape[1:] != (n, block, block) or bias.shape[0] not in (1, q.shape[0])):
        raise ValueError(f"bias shape {tuple(bias.shape)} must be (1 or batch, nnz={n}, {block}, {block})")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out, _ = block_sparse_attention_op(q.contiguous(), k.contiguous(), v.contiguous(), rows, cols, bias, scale,
                                       causal, block)
    return out
