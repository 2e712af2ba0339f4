"""Triton block-sparse attention (FlashAttention-style over a layout's non-zero blocks); the specification
is `kernels/block_sparse_attention.py`.

Called only through `deepfleet::block_sparse_attention` and its `_backward` op when the Triton path is
selected. The COO block list (rows, cols) is turned into CSR (by query block row) for the forward and dq
kernels, and CSC (by key block column) for the dk/dv kernel, so every program owns one output tile and
needs no atomics: forward and dq run one program per (query block row, batch) over that row's tiles with
an online softmax; dk/dv run one program per (key block column, batch) over that column's tiles. The
probabilities are recomputed from the forward's log-sum-exp. Tiles are padded to at least 16 x 16 (what
`tl.dot` needs) with masked loads. Math is fp32 with IEEE dots, whatever the input dtype (the CPU
interpreter's bf16 arithmetic is wrong, and fp32 dots keep the reference's accuracy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tile_scores(q, k_ptrs, kv_mask, bias_ptr, r, c, nb, block, scale, offs_m, offs_n,
                 HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr):  # fmt: skip
    """Scores (BLK, BLK) of query tile q against key tile (block column c), masked and biased."""
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    valid = (offs_m[:, None] < block) & (offs_n[None, :] < block)
    if HAS_BIAS:
        s += tl.load(bias_ptr + offs_m[:, None] * block + offs_n[None, :], mask=valid, other=0.0).to(tl.float32)
    if CAUSAL:
        qpos = (r % nb) * block + offs_m[:, None]
        kpos = (c % nb) * block + offs_n[None, :]
        valid = valid & (kpos <= qpos)
    return tl.where(valid, s, float("-inf"))


@triton.jit
def _forward(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bias_ptr, row_ptr, cols_ptr, n_rows, nb, block, head_dim, scale,
             bias_bstride,
             HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, BLK: tl.constexpr, DP: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLK)
    offs_n = tl.arange(0, BLK)
    offs_d = tl.arange(0, DP)
    tile = block * head_dim
    io_mask = (offs_m[:, None] < block) & (offs_d[None, :] < head_dim)
    base = (b * n_rows + r) * tile + offs_m[:, None] * head_dim + offs_d[None, :]
    q = tl.load(q_ptr + base, mask=io_mask, other=0.0).to(tl.float32)
    m_i = tl.full([BLK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLK], tl.float32)
    acc = tl.zeros([BLK, DP], tl.float32)
    kv_mask = (offs_n[:, None] < block) & (offs_d[None, :] < head_dim)
    start = tl.load(row_ptr + r)
    end = tl.load(row_ptr + r + 1)
    for idx in range(start, end):
        c = tl.load(cols_ptr + idx)
        kv = (b * n_rows + c) * tile + offs_n[:, None] * head_dim + offs_d[None, :]
        s = _tile_scores(q, k_ptr + kv, kv_mask, bias_ptr + b * bias_bstride + idx * block * block, r, c, nb, block,
                         scale, offs_m, offs_n, HAS_BIAS, CAUSAL)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(seen, m_safe + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    tl.store(o_ptr + base, out.to(o_ptr.dtype.element_ty), mask=io_mask)
    tl.store(lse_ptr + (b * n_rows + r) * block + offs_m, lse, mask=offs_m < block)


@triton.jit
def _backward_dq(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, bias_ptr, row_ptr, cols_ptr, n_rows, nb,
                 block, head_dim, scale, bias_bstride,
                 HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, BLK: tl.constexpr, DP: tl.constexpr):  # fmt: skip
    r = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLK)
    offs_n = tl.arange(0, BLK)
    offs_d = tl.arange(0, DP)
    tile = block * head_dim
    io_mask = (offs_m[:, None] < block) & (offs_d[None, :] < head_dim)
    base = (b * n_rows + r) * tile + offs_m[:, None] * head_dim + offs_d[None, :]
    q = tl.load(q_ptr + base, mask=io_mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + base, mask=io_mask, other=0.0).to(tl.float32)
    row_off = (b * n_rows + r) * block + offs_m
    lse = tl.load(lse_ptr + row_off, mask=offs_m < block, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # a query that sees nothing has p = 0
    delta = tl.load(delta_ptr + row_off, mask=offs_m < block, other=0.0)
    dq = tl.zeros([BLK, DP], tl.float32)
    kv_mask = (offs_n[:, None] < block) & (offs_d[None, :] < head_dim)
    for idx in range(tl.load(row_ptr + r), tl.load(row_ptr + r + 1)):
        c = tl.load(cols_ptr + idx)
        kv = (b * n_rows + c) * tile + offs_n[:, None] * head_dim + offs_d[None, :]
        s = _tile_scores(q, k_ptr + kv, kv_mask, bias_ptr + b * bias_bstride + idx * block * block, r, c, nb, block,
                         scale, offs_m, offs_n, HAS_BIAS, CAUSAL)
        p = tl.exp(s - lse[:, None])
        v = tl.load(v_ptr + kv, mask=kv_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + kv, mask=kv_mask, other=0.0).to(tl.float32)
        ds = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None])
        dq += tl.dot(ds, k, input_precision="ieee")
    tl.store(dq_ptr + base, (dq * scale).to(dq_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _backward_dkdv(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, bias_ptr, col_ptr, perm_ptr,
                   rows_ptr, n_rows, nb, block, head_dim, scale, bias_bstride,
                   HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, BLK: tl.constexpr, DP: tl.constexpr):  # fmt: skip
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLK)
    offs_n = tl.arange(0, BLK)
    offs_d = tl.arange(0, DP)
    tile = block * head_dim
    kv_mask = (offs_n[:, None] < block) & (offs_d[None, :] < head_dim)
    kv = (b * n_rows + c) * tile + offs_n[:, None] * head_dim + offs_d[None, :]
    v = tl.load(v_ptr + kv, mask=kv_mask, other=0.0).to(tl.float32)
    dk = tl.zeros([BLK, DP], tl.float32)
    dv = tl.zeros([BLK, DP], tl.float32)
    io_mask = (offs_m[:, None] < block) & (offs_d[None, :] < head_dim)
    for j in range(tl.load(col_ptr + c), tl.load(col_ptr + c + 1)):
        idx = tl.load(perm_ptr + j)  # the tile's position in the row-sorted list (its bias slot)
        r = tl.load(rows_ptr + idx)
        base = (b * n_rows + r) * tile + offs_m[:, None] * head_dim + offs_d[None, :]
        q = tl.load(q_ptr + base, mask=io_mask, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + base, mask=io_mask, other=0.0).to(tl.float32)
        row_off = (b * n_rows + r) * block + offs_m
        lse = tl.load(lse_ptr + row_off, mask=offs_m < block, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)
        delta = tl.load(delta_ptr + row_off, mask=offs_m < block, other=0.0)
        s = _tile_scores(q, k_ptr + kv, kv_mask, bias_ptr + b * bias_bstride + idx * block * block, r, c, nb, block,
                         scale, offs_m, offs_n, HAS_BIAS, CAUSAL)
        p = tl.exp(s - lse[:, None])  # (BLK queries, BLK keys)
        dv += tl.dot(tl.trans(p), do, input_precision="ieee")
        ds = p * (tl.dot(do, tl.trans(v), input_precision="ieee") - delta[:, None])
        dk += tl.dot(tl.trans(ds), q, input_precision="ieee")
    tl.store(dk_ptr + kv, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + kv, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


def _geometry(q: torch.Tensor, block: int) -> tuple[int, int, int, int, int]:
    b, h, s, d = q.shape
    nb = s // block
    return b, h * nb, nb, max(16, triton.next_power_of_2(block)), max(16, triton.next_power_of_2(d))


def _pointers(rows: torch.Tensor, n_rows: int) -> torch.Tensor:
    """CSR/CSC offsets (n_rows + 1,) of a sorted index list."""
    counts = torch.bincount(rows, minlength=n_rows)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int64)


def _bias_args(q: torch.Tensor, bias: torch.Tensor | None, block: int) -> tuple[torch.Tensor, int]:
    if bias is None:
        return q.new_zeros(1, dtype=torch.float32), 0
    bias = bias.float().contiguous()
    return bias, (bias.shape[1] * block * block if bias.shape[0] > 1 else 0)


def forward(q, k, v, rows, cols, bias, scale, causal, block):
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    batch, n_rows, nb, blk, dp = _geometry(q, block)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    order = torch.argsort(rows, stable=True)  # rows are sorted already when built by layout_blocks
    rows, cols = rows[order], cols[order]
    bias_t, bstride = _bias_args(q, None if bias is None else bias[:, order], block)
    if q.numel():
        _forward[(n_rows, batch)](
            q, k, v, out, lse, bias_t, _pointers(rows, n_rows), cols.contiguous(), n_rows, nb, block, q.shape[-1],
            scale, bstride, HAS_BIAS=bias is not None, CAUSAL=causal, BLK=blk, DP=dp,
        )  # fmt: skip
    return out, lse


def backward(dout, q, k, v, out, lse, rows, cols, bias, scale, causal, block):
    q, k, v, dout = q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    batch, n_rows, nb, blk, dp = _geometry(q, block)
    order = torch.argsort(rows, stable=True)
    rows, cols = rows[order], cols[order]
    bias_t, bstride = _bias_args(q, None if bias is None else bias[:, order], block)
    delta = (dout.float() * out.float()).sum(-1).contiguous()  # (B, H, S): rowsum(dO * O)
    lse = lse.float().contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if not q.numel():
        return dq, dk, dv
    flags = dict(HAS_BIAS=bias is not None, CAUSAL=causal, BLK=blk, DP=dp)
    _backward_dq[(n_rows, batch)](
        q, k, v, dout, lse, delta, dq, bias_t, _pointers(rows, n_rows), cols.contiguous(), n_rows, nb, block,
        q.shape[-1], scale, bstride, **flags,
    )  # fmt: skip
    perm = torch.argsort(cols, stable=True)
    _backward_dkdv[(n_rows, batch)](
        q, k, v, dout, lse, delta, dk, dv, bias_t, _pointers(cols[perm], n_rows), perm.contiguous(),
        rows.contiguous(), n_rows, nb, block, q.shape[-1], scale, bstride, **flags,
    )  # fmt: skip
    return dq, dk, dv
