"""MoE permute/unpermute: routing and the references against a naive per-token loop, gradcheck in
float64, Triton (interpreted) against the references over odd shapes, capacities and dtypes, and the
custom ops' registrations."""

from __future__ import annotations

import pytest
import torch

from deepfleet.kernels._dispatch import force_impl
from deepfleet.kernels.moe_permute import (
    moe_permute,
    moe_permute_op,
    moe_permute_reference,
    moe_route,
    moe_unpermute,
    moe_unpermute_backward_op,
    moe_unpermute_backward_reference,
    moe_unpermute_op,
    moe_unpermute_reference,
)
from tests.kernels.tolerance import assert_close

CASES = [  # (tokens, d, experts, k, capacity)
    (1, 1, 1, 1, None),
    (3, 17, 4, 2, 1),
    (41, 341, 8, 2, None),
    (24, 32, 8, 4, 5),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _topk(tokens: int, experts: int, k: int) -> torch.Tensor:
    return torch.rand(tokens, experts).topk(k, dim=-1).indices


def test_routing_matches_naive_slot_major_loop() -> None:
    topk = _topk(23, 5, 3)
    ranks, seen = torch.zeros_like(topk), [0] * 5
    for j in range(3):  # every first choice ranks before any second choice
        for t in range(23):
            ranks[t, j] = seen[int(topk[t, j])]
            seen[int(topk[t, j])] += 1
    starts = [sum(seen[:e]) for e in range(5)]
    for capacity in (None, 2, 4):
        row_map, counts = moe_route(topk, num_experts=5, capacity=capacity)
        expected = torch.full_like(topk, -1)
        for t in range(23):
            for j in range(3):
                e, r = int(topk[t, j]), int(ranks[t, j])
                if capacity is None:
                    expected[t, j] = starts[e] + r  # compact: experts back to back
                elif r < capacity:
                    expected[t, j] = e * capacity + r  # padded: expert e owns a block of `capacity` rows
        assert torch.equal(row_map, expected), capacity
        assert torch.equal(counts, torch.bincount(topk[row_map >= 0], minlength=5))


def test_references_match_naive_loops_and_gradcheck() -> None:
    x = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    gates = torch.rand(9, 2, dtype=torch.float64, requires_grad=True)
    row_map, _ = moe_route(_topk(9, 3, 2), num_experts=3, capacity=4)
    perm = moe_permute_reference(x, row_map, 12)
    out = moe_unpermute_reference(perm * 2.0, row_map, gates)
    for t in range(9):
        want = sum((2.0 * gates[t, j] * x[t] for j in range(2) if row_map[t, j] >= 0), torch.zeros(6, dtype=torch.float64))
        torch.testing.assert_close(out[t], want)
        for j in range(2):
            if row_map[t, j] >= 0:
                torch.testing.assert_close(perm[row_map[t, j]], x[t])
    assert torch.autograd.gradcheck(lambda a, g: moe_unpermute_reference(moe_permute_reference(a, row_map, 12), row_map, g), (x, gates))
    y = torch.randn(12, 6, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(9, 6, dtype=torch.float64)
    expected = torch.autograd.grad(moe_unpermute_reference(y, row_map, gates), (y, gates), dout)
    for got, want in zip(moe_unpermute_backward_reference(dout, y, row_map, gates), expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_matches_reference(case: tuple, dtype: torch.dtype) -> None:
    tokens, d, experts, k, capacity = case
    x = torch.randn(tokens, d).to(dtype).requires_grad_()
    topk = _topk(tokens, experts, k)
    gates = torch.rand(tokens, k).softmax(-1).requires_grad_()
    expert_w = 1 + torch.rand(1, d).to(dtype)  # a stand-in expert: rowwise scale, so grads flow through y

    def run():
        perm, row_map, counts = moe_permute(x, topk, num_experts=experts, capacity=capacity)
        return perm, counts, moe_unpermute(perm * expert_w, row_map, gates)

    perm_ref, counts_ref, out_ref = run()
    dout = torch.randn_like(out_ref)
    dx_ref, dg_ref = torch.autograd.grad(out_ref, (x, gates), dout)
    with force_impl("triton"):
        perm, counts, out = run()
        dx, dg = torch.autograd.grad(out, (x, gates), dout)
    assert torch.equal(counts, counts_ref)
    assert_close("moe_permute.fwd", perm, perm_ref)
    assert_close("moe_unpermute.fwd", out, out_ref, scale=2.0)
    assert_close("moe_permute.dx", dx, dx_ref, scale=2.0)
    assert_close("moe_unpermute.dgates", dg, dg_ref, scale=4.0 if dtype == torch.float32 else 1.0)


def test_opcheck(opcheck) -> None:
    x = torch.randn(6, 8, requires_grad=True)
    row_map, _ = moe_route(_topk(6, 3, 2), num_experts=3, capacity=3)
    gates = torch.rand(6, 2, requires_grad=True)
    y = torch.randn(9, 8, requires_grad=True)
    opcheck(moe_permute_op, (x, row_map, 9))
    opcheck(moe_unpermute_op, (y, row_map, gates))
    opcheck(moe_unpermute_backward_op, (torch.randn(6, 8), y.detach(), row_map, gates.detach()))


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="capacity=0"):
        moe_permute(torch.randn(2, 3), torch.zeros(2, 1, dtype=torch.long), num_experts=2, capacity=0)
    with pytest.raises(ValueError, match="gates"):
        moe_unpermute(torch.randn(4, 3), torch.zeros(2, 2, dtype=torch.long), torch.rand(2, 1))
