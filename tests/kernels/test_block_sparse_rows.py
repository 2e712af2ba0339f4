"""The row-batched CPU path of block-sparse attention equals the tile-wise specification, forward and
backward, over a table of odd shapes, random layouts (empty rows, rows of every block count, unsorted
and cross-head blocks), causal and bidirectional, with and without a bias, and with rows cut into chunks."""

from __future__ import annotations

import pytest
import torch

from deepfleet.kernels import block_sparse_rows
from deepfleet.kernels.block_sparse_attention import backward_reference, forward_reference, layout_blocks

CASES = [  # (batch, heads, blocks, block, head_dim, density, causal, bias, dtype)
    (1, 1, 1, 1, 1, 1.0, False, False, torch.float64),
    (2, 3, 5, 4, 7, 0.4, True, True, torch.float64),
    (1, 2, 7, 3, 5, 0.3, False, True, torch.float64),
    (3, 1, 6, 8, 2, 0.6, True, False, torch.float64),
    (2, 2, 9, 5, 3, 0.15, True, True, torch.float32),
    (1, 4, 4, 16, 9, 1.0, True, False, torch.float32),
    (2, 1, 8, 4, 4, 0.05, False, False, torch.float32),
]


def _inputs(batch, heads, nb, block, d, density, with_bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    layout = (torch.rand(heads, nb, nb, generator=g) < density).long()
    layout[0, 0, 0] = 1  # at least one block
    rows, cols = layout_blocks(layout)
    perm = torch.randperm(rows.numel(), generator=g)  # the op must not rely on the caller's order
    rows, cols = rows[perm], cols[perm]
    q, k, v, dout = (torch.randn(batch, heads, nb * block, d, generator=g, dtype=dtype) for _ in range(4))
    bias = torch.randn(batch, rows.numel(), block, block, generator=g, dtype=dtype) if with_bias else None
    return q, k, v, dout, rows, cols, bias


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize(("batch", "heads", "nb", "block", "d", "density", "causal", "with_bias", "dtype"), CASES,
                         ids=str)
def test_rows_path_equals_tile_reference(batch, heads, nb, block, d, density, causal, with_bias, dtype, chunked,
                                         monkeypatch) -> None:
    if chunked:  # one row per chunk: every group is cut
        monkeypatch.setattr(block_sparse_rows, "_CHUNK_ELEMENTS", 1)
    q, k, v, dout, rows, cols, bias = _inputs(batch, heads, nb, block, d, density, with_bias, dtype, seed=nb * d)
    scale = d ** -0.5
    tol = {"atol": 1e-10, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 1e-5, "rtol": 1e-5}
    out, lse = block_sparse_rows.forward(q, k, v, rows, cols, bias, scale, causal, block)
    ref_out, ref_lse = forward_reference(q, k, v, rows, cols, bias, scale, causal, block)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    grads = block_sparse_rows.backward(dout, q, k, v, out, lse, rows, cols, bias, scale, causal, block)
    ref_grads = backward_reference(dout, q, k, v, ref_out, ref_lse, rows, cols, bias, scale, causal, block)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"d{n}: {m}")


def test_plan_groups_rows_by_count_and_drops_blocks_above_the_diagonal() -> None:
    layout = torch.tensor([[[1, 1, 0], [1, 1, 1], [1, 0, 1]]])  # (1, 3, 3); block (0, 1) and (1, 2) are above
    rows, cols = layout_blocks(layout)
    chunks = block_sparse_rows.plan(rows, cols, n_cols=3, nb=3, causal=True, block=2, batch=1)
    got = sorted((ch.count, ch.diagonal, ch.rows.tolist(), ch.cols.tolist()) for ch in chunks)
    assert got == [(1, True, [0], [0]), (2, True, [1, 2], [0, 1, 0, 2])]
    everything = block_sparse_rows.plan(rows, cols, n_cols=3, nb=3, causal=False, block=2, batch=1)
    assert sum(ch.rows.numel() * ch.count for ch in everything) == rows.numel()
    assert not any(ch.diagonal for ch in everything)
