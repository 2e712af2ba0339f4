"""Pruning masks against reference formulas on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from deepfleet.engine.compression import masks as M


def test_topk_keeps_the_ceil_ratio_largest_and_passes_gradients() -> None:
    s = torch.tensor([[0.3, -1.0, 2.0], [0.1, 5.0, 0.0]], requires_grad=True)
    m = M.topk_mask(s, 0.5)  # ceil(0.5 * 6) = 3 kept: 5.0, 2.0, 0.3
    assert m.tolist() == [[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]
    (m * torch.arange(6.0).reshape(2, 3)).sum().backward()
    torch.testing.assert_close(s.grad, torch.arange(6.0).reshape(2, 3))
    assert M.topk_mask(torch.randn(7), 0.3).sum() == math.ceil(0.3 * 7)


def test_l1_mask_is_by_magnitude() -> None:
    w = torch.tensor([[0.3, -1.0], [2.0, -0.1]])
    assert M.l1_mask(w, 0.5).tolist() == [[0.0, 1.0], [1.0, 0.0]]


def test_two_four_pattern() -> None:
    w = torch.randn(6, 16, generator=torch.Generator().manual_seed(0))
    m = M.nm_mask(w, 2, 4)
    blocks = m.reshape(6, 4, 4)
    assert torch.all(blocks.sum(-1) == 2)
    ref = torch.zeros_like(blocks)
    for r in range(6):
        for b in range(4):
            vals = w.reshape(6, 4, 4)[r, b].abs()
            ref[r, b, vals.argsort(descending=True)[:2]] = 1.0
    assert torch.equal(blocks, ref)


def test_row_head_and_channel_scores() -> None:
    w = torch.tensor([[1.0, -2.0, 0.0, 0.0], [0.5, 0.5, 3.0, -3.0], [0.0, 0.0, 0.0, 0.25]])
    assert M.row_scores_l1(w).reshape(-1).tolist() == [3.0, 7.0, 0.25]
    assert M.topk_mask(M.row_scores_l1(w), 0.5).reshape(-1).tolist() == [1.0, 1.0, 0.0]
    # 2 heads of head_dim 2 over the 4 inputs: head 0 = cols 0-1 (|.| sum 4.0), head 1 = cols 2-3 (6.25)
    assert M.head_scores_l1(w, 2).tolist() == [[4.0, 6.25]]
    cols = M.head_columns(torch.tensor([[0.0, 1.0]]), 4)
    assert cols.tolist() == [[0.0, 0.0, 1.0, 1.0]]
    conv = torch.zeros(3, 2, 2, 2)
    conv[1] = 1.0
    conv[2] = -0.5
    assert M.row_scores_l1(conv).reshape(-1).tolist() == [0.0, 8.0, 4.0]
    assert M.row_scores_l1(conv).shape == (3, 1, 1, 1)


def test_ramp_moves_every_stride_from_dense_to_target() -> None:
    r = [M.ramped_ratio(s, dense_ratio=0.2, offset=10, end=20, stride=5) for s in (10, 14, 15, 19, 20, 50)]
    assert r == pytest.approx([1.0, 1.0, 0.6, 0.6, 0.2, 0.2])
    assert M.ramped_ratio(10, dense_ratio=0.5, offset=10, end=10, stride=1) == 0.5
