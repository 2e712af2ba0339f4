"""The CPU path of block-sparse attention: one softmax row per query block, batched over rows alike.

Called by `deepfleet.kernels.block_sparse_attention`'s custom ops (forward and backward) whenever Triton
does not run; its specification is the tile-wise `forward_reference`/`backward_reference` beside it,
and the tests compare the two over tables of odd shapes.

Why not the tile-wise form on the CPU: it multiplies `nnz` separate (blk x blk) tiles and then joins the
softmax of a row across its tiles with scatter reductions (`scatter_reduce_`, `index_add_`) over
nnz * blk values, several times per pass; profiled at 8k tokens those scatters, gathers and the extra
passes over the score tiles took most of the time, not the matrix products. Here every query block row
is one dense row of `c` key blocks (ELL form): the query tile is multiplied once against its `c` gathered
key blocks, (blk, D) @ (D, c * blk), the softmax is an ordinary row softmax, and the output is written
once per row (`index_copy_`), so only dk and dv are scattered. Rows are grouped by their block count
(rows of one group make one batched matmul, no padding and no wasted work) and, within a group, cut
into chunks of at most `_CHUNK_ELEMENTS` score values, so the peak extra memory is one chunk's scores
and gathered keys/values (bounded, and linear in the blocks), never a dense score matrix.

Causal: a block above the diagonal is fully masked, so it is dropped from the plan; each row's columns
are sorted, which puts its diagonal block (the only partly masked one) last, and one triangular mask of
(blk, blk) is applied in place to the last block of the rows that have it: no mask is materialized.

Shapes (legend: B batch, G rows in a chunk, c blocks per row, blk block, D head dim, R block rows):
  q/k/v tiles (B, R, blk, D); a chunk's scores (B, G, blk, c * blk); its gathered keys (B, G, c * blk, D).
Math is fp32 (float64 stays float64), as in the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# score values (B * G * blk * c * blk) per chunk: 4M fp32 = 16 MB of scores, a few times that in temporaries
_CHUNK_ELEMENTS = 1 << 22


class _Chunk(NamedTuple):
    rows: Tensor  # (G,) flat query block-row ids, unique over the whole plan
    cols: Tensor  # (G * c,) flat key/value block ids, row-major
    tiles: Tensor  # (G * c,) positions of those blocks in the caller's (rows, cols, bias)
    count: int  # c
    diagonal: bool  # causal: the last block of every row is its diagonal block


def plan(rows: Tensor, cols: Tensor, *, n_cols: int, nb: int, causal: bool, block: int,
         batch: int) -> list[_Chunk]:
    """Group the non-zero blocks (rows, cols) into row chunks of equal block count (each block listed once)."""
    tiles = torch.arange(rows.numel(), device=rows.device)
    if causal:  # blocks above the diagonal see nothing
        tiles = tiles[(cols % nb) <= (rows % nb)]
    tiles = tiles[torch.argsort(rows[tiles] * n_cols + cols[tiles])]  # by row, then column
    r, c = rows[tiles], cols[tiles]
    uniq, counts = torch.unique_consecutive(r, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    last = c[starts + counts - 1] if counts.numel() else c
    diag = ((last % nb) == (uniq % nb)) & causal
    key = counts * 2 + diag.long()
    chunks = []
    for k in torch.unique(key).tolist():
        sel = (key == k).nonzero().squeeze(1)
        count, diagonal = k // 2, bool(k % 2)
        step = max(1, _CHUNK_ELEMENTS // (batch * block * block * count))
        for lo in range(0, sel.numel(), step):
            part = sel[lo:lo + step]
            pos = (starts[part][:, None] + torch.arange(count, device=rows.device)).reshape(-1)
            chunks.append(_Chunk(uniq[part], c[pos], tiles[pos], count, diagonal))
    return chunks


def _chunk_scores(qt: Tensor, kt: Tensor, ch: _Chunk, bias: Tensor | None, block: int) -> tuple[Tensor, Tensor, Tensor]:
    """(qg (B, G, blk, D) scaled, kg (B, G, c * blk, D), s (B, G, blk, c * blk) biased and masked)."""
    b, _, _, d = qt.shape
    g = ch.rows.numel()
    qg = qt.index_select(1, ch.rows)
    kg = kt.index_select(1, ch.cols).view(b, g, ch.count * block, d)
    s = qg @ kg.transpose(-1, -2)
    if bias is not None:  # (1|B, N, blk, blk) -> (1|B, G, blk, c * blk), the row's tiles side by side
        bg = bias.index_select(1, ch.tiles).view(bias.shape[0], g, ch.count, block, block)
        s += bg.transpose(2, 3).reshape(bias.shape[0], g, block, ch.count * block).to(s.dtype)
    if ch.diagonal:
        upper = torch.ones(block, block, dtype=torch.bool, device=s.device).triu(1)
        s[..., -block:].masked_fill_(upper, float("-inf"))
    return qg, kg, s


def forward(q: Tensor, k: Tensor, v: Tensor, rows: Tensor, cols: Tensor, bias: Tensor | None, scale: float,
            causal: bool, block: int) -> tuple[Tensor, Tensor]:
    """(out (B, H, S, D) in q's dtype, lse (B, H, S)); equal to `forward_reference`."""
    b, h, s_len, d = q.shape
    nb = s_len // block
    acc = torch.promote_types(q.dtype, torch.float32)
    qt = (q.to(acc) * scale).reshape(b, h * nb, block, d)  # scale once on q: (blk, D), not (blk, c * blk)
    kt, vt = k.reshape(b, h * nb, block, d).to(acc), v.reshape(b, h * nb, block, d).to(acc)
    out = q.new_zeros((b, h * nb, block, d), dtype=acc)
    lse = q.new_full((b, h * nb, block), float("-inf"), dtype=acc)
    for ch in plan(rows, cols, n_cols=h * nb, nb=nb, causal=causal, block=block, batch=b):
        _, _, s = _chunk_scores(qt, kt, ch, bias, block)
        m = s.amax(-1, keepdim=True)  # (B, G, blk, 1)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # a row that sees nothing: exp() gives 0
        p = s.sub_(m).exp_()
        denom = p.sum(-1, keepdim=True)
        seen = denom > 0
        vg = vt.index_select(1, ch.cols).view(b, -1, ch.count * block, d)
        o = (p @ vg).div_(torch.where(seen, denom, torch.ones_like(denom)))
        row_lse = torch.where(seen, m + torch.log(torch.where(seen, denom, torch.ones_like(denom))), float("-inf"))
        out.index_copy_(1, ch.rows, o)
        lse.index_copy_(1, ch.rows, row_lse.squeeze(-1))
    return out.reshape(b, h, s_len, d).to(q.dtype), lse.reshape(b, h, s_len)


def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, rows: Tensor, cols: Tensor,
             bias: Tensor | None, scale: float, causal: bool, block: int) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), recomputing each chunk's probabilities from lse; equal to `backward_reference`."""
    b, h, s_len, d = q.shape
    nb = s_len // block
    acc = torch.promote_types(q.dtype, torch.float32)
    qt = (q.to(acc) * scale).reshape(b, h * nb, block, d)
    kt, vt = k.reshape(b, h * nb, block, d).to(acc), v.reshape(b, h * nb, block, d).to(acc)
    do_t = dout.reshape(b, h * nb, block, d).to(acc)
    delta = (do_t * out.reshape(b, h * nb, block, d).to(acc)).sum(-1)  # (B, R, blk): rowsum(dO * O)
    lse_t = lse.to(acc).reshape(b, h * nb, block)
    lse_t = torch.where(torch.isinf(lse_t), torch.full_like(lse_t, float("inf")), lse_t)  # unseen rows: p = 0
    dq, dk, dv = (torch.zeros((b, h * nb, block, d), dtype=acc, device=q.device) for _ in range(3))
    for ch in plan(rows, cols, n_cols=h * nb, nb=nb, causal=causal, block=block, batch=b):
        g = ch.rows.numel()
        qg, kg, s = _chunk_scores(qt, kt, ch, bias, block)
        p = s.sub_(lse_t.index_select(1, ch.rows)[..., None]).exp_()  # (B, G, blk, c * blk)
        vg = vt.index_select(1, ch.cols).view(b, g, ch.count * block, d)
        dog = do_t.index_select(1, ch.rows)  # (B, G, blk, D)
        ds = (dog @ vg.transpose(-1, -2)).sub_(delta.index_select(1, ch.rows)[..., None]).mul_(p)
        dq.index_copy_(1, ch.rows, ds @ kg)
        dk.index_add_(1, ch.cols, (ds.transpose(-1, -2) @ qg).view(b, g * ch.count, block, d))
        dv.index_add_(1, ch.cols, (p.transpose(-1, -2) @ dog).view(b, g * ch.count, block, d))
    dq = dq.mul_(scale)
    return (dq.reshape(q.shape).to(q.dtype), dk.reshape(k.shape).to(k.dtype), dv.reshape(v.shape).to(v.dtype))
