"""Block-sparse attention: the reference equals dense SDPA with the layout's mask expanded (forward and
backward, every layout mode, causal and bidirectional, with a bias), runs a sequence whose dense score
matrix would not fit in memory, the Triton kernel (interpreted) equals the reference, and the custom ops'
registrations hold."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from deepfleet.engine.attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    VariableSparsityConfig,
)
from deepfleet.kernels._dispatch import force_impl
from deepfleet.kernels.block_sparse_attention import (
    block_sparse_attention,
    block_sparse_attention_backward_op,
    block_sparse_attention_op,
    expand_layout,
    layout_blocks,
)
from tests.kernels.tolerance import assert_close

HEADS, BLOCK = 3, 4
MODES = {
    "dense": lambda a: DenseSparsityConfig(HEADS, block=BLOCK),
    "fixed": lambda a: FixedSparsityConfig(HEADS, block=BLOCK, num_local_blocks=2, attention=a,
                                           different_layout_per_head=True, num_different_global_patterns=2),
    "variable": lambda a: VariableSparsityConfig(HEADS, block=BLOCK, num_random_blocks=1, local_window_blocks=[1, 2],
                                                 global_block_indices=[1], attention=a),
    "bigbird": lambda a: BigBirdSparsityConfig(HEADS, block=BLOCK, different_layout_per_head=True, attention=a),
    "bslongformer": lambda a: BSLongformerSparsityConfig(HEADS, block=BLOCK, global_block_indices=[2], attention=a),
    "local": lambda a: LocalSlidingWindowSparsityConfig(HEADS, block=BLOCK, attention=a),
}


def _dense(q, k, v, layout, *, causal, bias_dense=None):
    mask = expand_layout(layout, BLOCK, causal=causal)  # (H, S, S)
    additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    if bias_dense is not None:
        additive = additive + bias_dense
    return F.scaled_dot_product_attention(q, k, v, attn_mask=additive)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_reference_equals_dense_masked_attention(mode: str, causal: bool) -> None:
    random.seed(0)
    layout = MODES[mode]("unidirectional" if causal else "bidirectional").make_layout(6 * BLOCK)  # (H, 6, 6)
    rows, cols = layout_blocks(layout)
    q, k, v = (torch.randn(2, HEADS, 6 * BLOCK, 5, requires_grad=True) for _ in range(3))
    out = block_sparse_attention(q, k, v, rows, cols, block=BLOCK, causal=causal)
    ref = _dense(q, k, v, layout, causal=causal)
    dy = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), dy)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dy)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


def test_bias_gathers_per_tile_and_fully_masked_rows_give_zero() -> None:
    layout = BigBirdSparsityConfig(2, block=BLOCK).make_layout(4 * BLOCK)
    rows, cols = layout_blocks(layout)
    q, k, v = (torch.randn(2, 2, 4 * BLOCK, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    dense_bias = torch.randn(2, 4 * BLOCK, 4 * BLOCK, dtype=torch.float64)  # (H, S, S)
    dense_bias[:, 5, :] = float("-inf")  # query 5 of every head sees nothing
    bias = _tile_bias(dense_bias, rows, cols, 4)
    out = block_sparse_attention(q, k, v, rows, cols, block=BLOCK, bias=bias)
    assert bool((out[:, :, 5] == 0).all())
    keep = torch.ones(4 * BLOCK, dtype=torch.bool)
    keep[5] = False
    ref = _dense(q, k, v, layout, causal=False, bias_dense=dense_bias)
    torch.testing.assert_close(out[:, :, keep], ref[:, :, keep])
    dy = torch.randn_like(out)
    dy[:, :, 5] = 0
    grads = torch.autograd.grad(out, (q, k, v), dy)
    ref_grads = torch.autograd.grad(ref[:, :, keep], (q, k, v), dy[:, :, keep])
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def _tile_bias(dense: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, nb: int) -> torch.Tensor:
    """(H, S, S) -> (1, nnz, blk, blk): the tile of each non-zero block."""
    h = dense.shape[0]
    tiles = dense.reshape(h, nb, BLOCK, nb, BLOCK).permute(0, 1, 3, 2, 4)  # (H, nb, nb, blk, blk)
    return tiles[rows // nb, rows % nb, cols % nb][None]


def test_long_sequence_runs_in_memory_linear_in_blocks() -> None:
    # 65,536 tokens: a dense fp32 score matrix is 17 GB per head; the local layout's 3 * 4,096 tiles are 12 MB.
    layout = LocalSlidingWindowSparsityConfig(1, block=16, attention="bidirectional").make_layout(65536)
    rows, cols = layout_blocks(layout)
    assert rows.numel() == 3 * 4096 - 2
    q, k, v = (torch.randn(1, 1, 65536, 8, requires_grad=True) for _ in range(3))
    out = block_sparse_attention(q, k, v, rows, cols, block=16)
    out.sum().backward()
    # token 40,000 only sees blocks 2,499..2,501: check it against attention over that window
    window = slice(2499 * 16, 2502 * 16)
    ref = F.scaled_dot_product_attention(q[:, :, 40000:40001], k[:, :, window], v[:, :, window])
    torch.testing.assert_close(out[:, :, 40000:40001], ref)
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())


@pytest.mark.parametrize(("dtype", "atol"), [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)], ids=str)
def test_half_precision_within_documented_tolerance(dtype: torch.dtype, atol: float) -> None:
    layout = FixedSparsityConfig(2, block=BLOCK, num_local_blocks=2).make_layout(5 * BLOCK)
    rows, cols = layout_blocks(layout)
    q, k, v = (torch.randn(1, 2, 5 * BLOCK, 8) for _ in range(3))
    ref = block_sparse_attention(q, k, v, rows, cols, block=BLOCK)
    out = block_sparse_attention(q.to(dtype), k.to(dtype), v.to(dtype), rows, cols, block=BLOCK)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=atol)


TRITON_CASES = [  # (dtype, causal, with bias, mode)
    (torch.float32, True, True, "bigbird"),
    (torch.float32, False, False, "variable"),
    (torch.bfloat16, False, True, "fixed"),
    (torch.float16, True, False, "bslongformer"),
]


@pytest.mark.parametrize(("dtype", "causal", "with_bias", "mode"), TRITON_CASES, ids=str)
def test_triton_matches_reference(dtype: torch.dtype, causal: bool, with_bias: bool, mode: str) -> None:
    random.seed(1)
    layout = MODES[mode]("unidirectional" if causal else "bidirectional").make_layout(5 * BLOCK)
    rows, cols = layout_blocks(layout)
    q, k, v = (torch.randn(2, HEADS, 5 * BLOCK, 6).to(dtype).requires_grad_() for _ in range(3))
    bias = torch.randn(2, rows.numel(), BLOCK, BLOCK) if with_bias else None
    dy = torch.randn(q.shape).to(dtype)
    ref = block_sparse_attention(q, k, v, rows, cols, block=BLOCK, bias=bias, causal=causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dy)
    with force_impl("triton"):
        out = block_sparse_attention(q, k, v, rows, cols, block=BLOCK, bias=bias, causal=causal)
        grads = torch.autograd.grad(out, (q, k, v), dy)
    assert_close("block_sparse_attention.fwd", out, ref, scale=2.0)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert_close(f"block_sparse_attention.d{name}", g, r, scale=2.0)


def test_opcheck(opcheck) -> None:
    layout = BigBirdSparsityConfig(1, block=2).make_layout(6)
    rows, cols = layout_blocks(layout)
    q, k, v = (torch.randn(1, 1, 6, 4, requires_grad=True) for _ in range(3))
    opcheck(block_sparse_attention_op, (q, k, v, rows, cols, None, 0.5, True, 2))
    out, lse = block_sparse_attention_op(q, k, v, rows, cols, None, 0.5, True, 2)
    dy = torch.randn_like(out)
    opcheck(block_sparse_attention_backward_op,
            (dy, q.detach(), k.detach(), v.detach(), out.detach(), lse, rows, cols, None, 0.5, True, 2))


def test_rejects_bad_inputs() -> None:
    rows, cols = layout_blocks(DenseSparsityConfig(1, block=4).make_layout(8))
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match="multiple of block"):
        block_sparse_attention(q[:, :, :6], q[:, :, :6], q[:, :, :6], rows, cols, block=4)
    with pytest.raises(ValueError, match="bias shape"):
        block_sparse_attention(q, q, q, rows, cols, block=4, bias=torch.zeros(1, 3, 4, 4))
    with pytest.raises(ValueError, match="must be equal"):
        block_sparse_attention(q, q[:, :, :4], q, rows, cols, block=4)
    with pytest.raises(ValueError, match="layout shape"):
        layout_blocks(torch.ones(2, 3))
