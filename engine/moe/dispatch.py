"""Token dispatch for the MoE layer: assignment -> row placement (`route`), and the expert-parallel
exchange of rows between the ranks of the `ep` group (`exchange`, `ExpertParallelDispatch`).
Caller: `moe/layer.py`.

Placement uses `kernels/moe_permute.py` (`moe_route` for the index math, `moe_permute_op` /
`moe_unpermute_op` to move rows, Triton on GPU, the torch reference on CPU). Its ranking is slot-major
token order; a gate that wants another keep-order under a capacity (random token selection, highest
probability first) gives a `priority` score, and the assignments are ranked by it instead (each
assignment becomes its own one-choice row in priority order, then the rows map back).

Expert parallelism: E = ep * L experts, rank r of the ep group owns global experts [r * L, (r + 1) * L).
With a capacity the permuted buffer is padded, (E * C, d), expert-major, so rank r's share is one
contiguous block of L * C rows and the all-to-all splits are equal (no host sync). Dropless, the buffer
is compact, (sum counts, d); the per-expert counts go through one small all-to-all first, the splits
are uneven (gloo handles them), and the received rows (source-rank-major) are regrouped by local
expert before the expert computation and put back after.

Why our own autograd around `all_to_all_single`: torch's differentiable version lives in the private
`_functional_collectives` and was seen to abort at exit on gloo (notes/torch-cpu-facts.md); ours is
the plain collective through `engine.comm` (counted), and its backward is the reverse exchange.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from deepfleet.engine import comm
from deepfleet.kernels.moe_permute import moe_permute_op, moe_route


def route(topk_idx: Tensor, *, num_experts: int, capacity: int | None,
          priority: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(row_map (T, k) int64 with -1 for dropped, kept counts (E,)) under `capacity` (None: dropless),
    ranking assignments by `priority` (T, k) (higher first) when given, else slot-major token order."""
    if priority is None or capacity is None:
        return moe_route(topk_idx, num_experts=num_experts, capacity=capacity)
    tokens, k = topk_idx.shape
    order = torch.argsort(priority.reshape(-1), descending=True, stable=True)  # (T * k,)
    rows, counts = moe_route(topk_idx.reshape(-1, 1)[order], num_experts=num_experts, capacity=capacity)
    row_map = torch.empty_like(rows.view(-1))
    row_map[order] = rows.view(-1)
    return row_map.view(tokens, k), counts


def permute_rows(x: Tensor, row_map: Tensor, num_rows: int) -> Tensor:
    """Rows of x (T, d) placed at row_map (T, k); (num_rows, d), unused rows zero. Differentiable."""
    return moe_permute_op(x, row_map, num_rows)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over `group` with splits; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, send: list[int] | None, recv: list[int] | None) -> Tensor:
        ctx.group, ctx.send, ctx.recv = group, send, recv
        x = x.contiguous()
        rows = sum(recv) if recv is not None else x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        comm.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=group,
                               log_name="moe_all_to_all")
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _AllToAll.apply(grad, ctx.group, ctx.recv, ctx.send), None, None, None


def exchange(x: Tensor, group: Any, *, send: list[int] | None = None, recv: list[int] | None = None) -> Tensor:
    """Differentiable all-to-all of x's rows over `group` (equal splits when `send`/`recv` are None)."""
    return _AllToAll.apply(x, group, send, recv)


class ExpertParallelDispatch:
    """One forward's exchange of permuted rows to the ranks owning their experts and back.

    `to_experts(permuted, counts)` returns `(rows, local_counts)`: the rows this rank's L experts process,
    expert-major, and how many each got; `to_tokens(rows)` returns the expert outputs in the layout
    `permuted` had, ready for `moe_unpermute`."""

    def __init__(self, group: Any, *, ep_size: int, num_local_experts: int, capacity: int | None) -> None:
        self.group, self.ep, self.local = group, ep_size, num_local_experts
        self.capacity = capacity

    def to_experts(self, permuted: Tensor, counts: Tensor) -> tuple[Tensor, list[int]]:
        d = permuted.shape[1]
        if self.capacity is not None:
            c, ep, local = self.capacity, self.ep, self.local
            got = exchange(permuted, self.group)  # (ep * L * C, d), source-rank-major
            # (source, expert, slot) -> (expert, source, slot): each expert's rows contiguous
            rows = got.view(ep, local, c, d).transpose(0, 1).reshape(local * ep * c, d)
            return rows, [ep * c] * local
        # dropless: learn how many rows each source sends for each of this rank's experts
        per_expert = counts.to(torch.int64).view(self.ep, self.local)  # (dest, L)
        incoming = torch.empty_like(per_expert)
        comm.all_to_all_single(incoming, per_expert, group=self.group, log_name="moe_all_to_all_counts")
        self._send = per_expert.sum(1).tolist()
        self._recv = incoming.sum(1).tolist()
        got = exchange(permuted, self.group, send=self._send, recv=self._recv)  # (sum recv, d)
        # rows arrive grouped (source, expert); regroup as (expert, source)
        source_major = incoming.reshape(-1)  # (ep * L,) segment lengths in arrival order
        starts = torch.cumsum(source_major, 0) - source_major
        seg = torch.arange(self.ep * self.local).view(self.ep, self.local).t().reshape(-1)  # expert-major
        order = torch.cat([torch.arange(int(starts[s]), int(starts[s] + source_major[s])) for s in seg.tolist()])
        self._order = order
        rows = got.index_select(0, order) if order.numel() else got
        return rows, incoming.sum(0).tolist()

    def to_tokens(self, rows: Tensor) -> Tensor:
        d = rows.shape[1]
        if self.capacity is not None:
            c, ep, local = self.capacity, self.ep, self.local
            back = rows.view(local, ep, c, d).transpose(0, 1).reshape(ep * local * c, d)
            return exchange(back, self.group)
        back = torch.empty_like(rows) if rows.shape[0] == 0 else _unorder(rows, self._order)
        return exchange(back, self.group, send=self._recv, recv=self._send)


def _unorder(rows: Tensor, order: Tensor) -> Tensor:
    """Inverse of rows = got[order], differentiable: got[order[i]] = rows[i]."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return rows.index_select(0, inverse)
