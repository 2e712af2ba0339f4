"""MoE token permutation: `moe_permute` groups token rows by expert from top-k routing (with capacity
dropping) and `moe_unpermute` scatters expert outputs back, weighted by the gates; both differentiable.

Meant for an MoE layer, around the all-to-all dispatch and the expert GEMMs; the engine has no MoE layer
yet, so nothing in deepfleet calls it. The pure-torch functions here are the specification and the CPU
path; `deepfleet::moe_permute` and `deepfleet::moe_unpermute` are the custom ops that dispatch to them or
to `kernels/_triton/moe_permute.py` (see `_dispatch`).

Routing (`moe_route`, index math in torch): assignments are ranked slot-major -- every token's first
choice before any second choice, tokens in order within a slot -- so under a capacity the top-1 choices
are kept first. An assignment whose rank within its expert is >= capacity is dropped (row -1).
Layouts: with a capacity the permuted buffer is padded, (experts * capacity, d), expert e owning rows
[e * capacity, (e + 1) * capacity) and unused rows zero (a fixed size: no host sync, equal all-to-all
splits); without one it is compact and dropless, (tokens * k, d), experts back to back.
Shapes: x (tokens, d), topk_idx and gates (tokens, k), row_map (tokens, k) int64, counts (experts,).
Backward: permute's is unpermute with unit gates; unpermute's is a gate-scaled permute plus
dgates[t, j] = <dout[t], y[row_map[t, j]]>. Math in fp32, outputs in the input dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepfleet.kernels._dispatch import triton_module, use_triton


def moe_route(topk_idx: Tensor, *, num_experts: int, capacity: int | None = None) -> tuple[Tensor, Tensor]:
    """Destination row of every (token, slot) assignment, -1 if dropped, and kept rows per expert."""
    tokens, k = topk_idx.shape
    flat = topk_idx.t().reshape(-1)  # (k * tokens,) slot-major priority
    sorted_experts, order = torch.sort(flat, stable=True)
    counts_all = torch.bincount(flat, minlength=num_experts)  # (experts,)
    starts = torch.cumsum(counts_all, 0) - counts_all
    rank = torch.empty_like(flat)
    rank[order] = torch.arange(flat.numel(), device=flat.device) - starts[sorted_experts]
    if capacity is None:
        rows, counts = starts[flat] + rank, counts_all
    else:
        counts = counts_all.clamp(max=capacity)
        rows = torch.where(rank < capacity, flat * capacity + rank, -1)
    return rows.view(k, tokens).t().contiguous(), counts


def moe_permute_reference(x: Tensor, row_map: Tensor, num_rows: int) -> Tensor:
    """The specification: permuted[row_map[t, j]] = x[t] for kept assignments, other rows zero."""
    kept = row_map >= 0  # (tokens, k)
    token = torch.arange(x.shape[0], device=x.device)[:, None].expand_as(row_map)
    out = x.new_zeros(num_rows, x.shape[1])
    return out.index_put((row_map[kept],), x[token[kept]])


def moe_unpermute_reference(y: Tensor, row_map: Tensor, gates: Tensor) -> Tensor:
    """The specification: out[t] = sum_j gates[t, j] * y[row_map[t, j]] over kept assignments (fp32)."""
    acc = torch.promote_types(y.dtype, torch.float32)
    kept = row_map >= 0
    picked = y.to(acc)[row_map.clamp(min=0)]  # (tokens, k, d)
    weights = torch.where(kept, gates.to(acc), 0.0).unsqueeze(-1)
    return (picked * weights).sum(1).to(y.dtype)


def moe_unpermute_backward_reference(
    dout: Tensor, y: Tensor, row_map: Tensor, gates: Tensor
) -> tuple[Tensor, Tensor]:
    """(dy, dgates) of `moe_unpermute_reference` in closed form."""
    acc = torch.promote_types(y.dtype, torch.float32)
    kept = row_map >= 0
    token = torch.arange(dout.shape[0], device=dout.device)[:, None].expand_as(row_map)
    scaled = dout.to(acc)[token[kept]] * gates.to(acc)[kept].unsqueeze(-1)  # (kept, d)
    dy = torch.zeros(y.shape, dtype=acc, device=y.device).index_put((row_map[kept],), scaled)
    dgates = (dout.to(acc).unsqueeze(1) * y.to(acc)[row_map.clamp(min=0)]).sum(-1)  # (tokens, k)
    return dy.to(y.dtype), torch.where(kept, dgates, 0.0).to(gates.dtype)


@torch.library.custom_op("deepfleet::moe_permute", mutates_args=())
def moe_permute_op(x: Tensor, row_map: Tensor, num_rows: int) -> Tensor:
    if use_triton(x, row_map):
        return triton_module("moe_permute").moe_permute(x, row_map, num_rows)
    return moe_permute_reference(x, row_map, num_rows)


@moe_permute_op.register_fake
def _(x: Tensor, row_map: Tensor, num_rows: int) -> Tensor:
    return x.new_empty(num_rows, x.shape[1])


@torch.library.custom_op("deepfleet::moe_unpermute", mutates_args=())
def moe_unpermute_op(y: Tensor, row_map: Tensor, gates: Tensor) -> Tensor:
    if use_triton(y, row_map, gates):
        return triton_module("moe_permute").moe_unpermute(y, row_map, gates)
    return moe_unpermute_reference(y, row_map, gates)


@moe_unpermute_op.register_fake
def _(y: Tensor, row_map: Tensor, gates: Tensor) -> Tensor:
    return y.new_empty(row_map.shape[0], y.shape[1])


@torch.library.custom_op("deepfleet::moe_unpermute_backward", mutates_args=())
def moe_unpermute_backward_op(dout: Tensor, y: Tensor, row_map: Tensor, gates: Tensor) -> tuple[Tensor, Tensor]:
    if use_triton(dout, y, row_map, gates):
        return triton_module("moe_permute").moe_unpermute_backward(dout, y, row_map, gates)
    return moe_unpermute_backward_reference(dout, y, row_map, gates)


@moe_unpermute_backward_op.register_fake
def _(dout: Tensor, y: Tensor, row_map: Tensor, gates: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(y), torch.empty_like(gates)


def _permute_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[1])


def _permute_backward(ctx, dperm: Tensor) -> tuple[Tensor, None, None]:
    (row_map,) = ctx.saved_tensors
    ones = torch.ones(row_map.shape, dtype=torch.float32, device=row_map.device)
    return moe_unpermute_op(dperm, row_map, ones), None, None


def _unpermute_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _unpermute_backward(ctx, dout: Tensor) -> tuple[Tensor, None, Tensor]:
    y, row_map, gates = ctx.saved_tensors
    dy, dgates = moe_unpermute_backward_op(dout, y, row_map, gates)
    return dy, None, dgates


moe_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)
moe_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def moe_permute(
    x: Tensor, topk_idx: Tensor, *, num_experts: int, capacity: int | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Group x's rows by expert; returns (permuted, row_map, counts). See the module docstring for layouts."""
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"moe_permute: x {tuple(x.shape)} must be (tokens, d) and topk_idx {tuple(topk_idx.shape)} (tokens, k)"
        )
    if capacity is not None and capacity < 1:
        raise ValueError(f"moe_permute: capacity={capacity} must be >= 1 (or None for dropless)")
    row_map, counts = moe_route(topk_idx, num_experts=num_experts, capacity=capacity)
    num_rows = num_experts * capacity if capacity is not None else topk_idx.numel()
    return moe_permute_op(x, row_map, num_rows), row_map, counts


def moe_unpermute(y: Tensor, row_map: Tensor, gates: Tensor) -> Tensor:
    """Combine expert outputs y (rows, d) back to tokens: out[t] = sum_j gates[t, j] * y[row_map[t, j]]."""
    if gates.shape != row_map.shape:
        raise ValueError(f"moe_unpermute: gates {tuple(gates.shape)} must match row_map {tuple(row_map.shape)}")
    return moe_unpermute_op(y, row_map, gates)
