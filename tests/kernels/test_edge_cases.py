"""Inputs the shape tables leave out: zero rows and non-contiguous views, on both implementations."""

from __future__ import annotations

import pytest
import torch

from deepfleet.kernels._dispatch import force_impl
from deepfleet.kernels.cross_entropy import cross_entropy
from deepfleet.kernels.geglu import geglu
from deepfleet.kernels.layer_norm import layer_norm
from deepfleet.kernels.moe_permute import moe_permute, moe_unpermute
from deepfleet.kernels.onebit_pack import onebit_pack
from deepfleet.kernels.rms_norm import rms_norm
from deepfleet.kernels.rope import rope, rope_cos_sin
from deepfleet.kernels.swiglu import swiglu


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_zero_rows(impl: str) -> None:
    x = torch.randn(0, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    with force_impl(impl):
        for out in (rms_norm(x, w), layer_norm(x, w, w), swiglu(x, x), geglu(x, x)):
            assert out.shape == (0, 8)
            out.sum().backward()
        assert cross_entropy(x, torch.zeros(0, dtype=torch.long), reduction="sum").item() == 0.0
        packed, scales = onebit_pack(torch.randn(0), torch.zeros(0), chunk_size=8)
        assert packed.numel() == scales.numel() == 0
        perm, row_map, counts = moe_permute(x, torch.zeros(0, 2, dtype=torch.long), num_experts=3)
        assert perm.shape == (0, 8) and counts.tolist() == [0, 0, 0]
        assert moe_unpermute(perm, row_map, torch.zeros(0, 2)).shape == (0, 8)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_non_contiguous_inputs_match_contiguous(impl: str) -> None:
    base = torch.randn(16, 6)
    x = base.t()  # (6, 16), strided
    w = torch.randn(16)
    q = torch.randn(2, 4, 3, 8).transpose(1, 2).contiguous().transpose(1, 2)  # (2, 4, 3, 8), strided
    cos, sin = rope_cos_sin(4, 8)
    with force_impl(impl):
        torch.testing.assert_close(rms_norm(x, w), rms_norm(x.contiguous(), w))
        torch.testing.assert_close(swiglu(x, x), swiglu(x.contiguous(), x.contiguous()))
        torch.testing.assert_close(rope(q, cos, sin), rope(q.contiguous(), cos, sin))
        t = torch.tensor([0, 3, 15, -100, 7, 1])
        torch.testing.assert_close(cross_entropy(x, t), cross_entropy(x.contiguous(), t))
