"""Overflow agreement and global-norm clipping, written once for every ZeRO strategy.

Callers: `zero/ddp.py` (stage 0), `zero/stage1.py` and `zero/partitioned.py` (stages 1 and 2) and
`zero/fsdp.py` (stage 3), from their `finish_gradients` and `clip_grad_norm_`. Each stage holds its
gradients differently — whole replicated tensors (stage 0), this rank's rows as `DTensor` `Shard(0)`
views (stages 1/2), FSDP2's `DTensor` shards (stage 3) — and these two functions take all of them:

- a plain tensor is *whole*: every rank that passes it holds the same complete gradient, so its
  squares count once, with no communication;
- a `DTensor` counts as its local shard; shards of one 1-D mesh are summed over that mesh's process
  group with one all-reduce per mesh (not one per tensor), so the norm is the whole-model norm whatever
  the sharding. A `Replicate` DTensor counts once, like a plain tensor.

Where the norm is taken anyway (it always is: `clip_grad_norm_` reports it even without clipping),
a strategy may take it first and read overflow from it — the norm is nonfinite exactly when some
element is (or when the squares overflow fp32, an update no step should apply) — which saves the
per-tensor `isfinite` pass (every stage does; `clip_to_norm_` then clips with it). Stages 1-3 reduce
the norm over their shards, so that all-reduce is also the agreement; stage 0, whose norm needs no
communication, agrees on one element. `any_nonfinite` stays for callers without a norm.
DeepSpeed's stage 1/2 in fp32 also runs no separate overflow check and reads an invalid norm as one.

`torch.nn.utils.clip_grad_norm_` would also handle DTensors, but it reduces every sharded tensor's
norm separately (one collective per parameter) and needs all tensors on one mesh; stages 1/2 may carry
several process groups (one per param group), hence this module.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from deepfleet.engine import comm

_ACCUMULATE = torch.float32  # dtype the squared norms are summed in


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def any_nonfinite(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> bool:
    """True if any element of `tensors` (local shards of DTensors) is inf or nan on any rank of `group`
    (None: the default group). Every rank of `group` must call it and gets the same answer: one rank's
    overflow skips the step everywhere."""
    locals_ = [_local(t) for t in tensors if t.numel()]
    device = locals_[0].device if locals_ else torch.device("cpu")
    if locals_:
        flags = torch.stack([(~torch.isfinite(t)).any() for t in locals_]).any()
        flag = flags.to(torch.float32).reshape(1)
    else:
        flag = torch.zeros(1, device=device)
    comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=group)
    return bool(flag.item() > 0)


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=_ACCUMULATE, device=device)
    norms = torch._foreach_norm(tensors, 2.0)
    return torch.stack([n.to(_ACCUMULATE) for n in norms]).pow(2).sum()


def global_norm(grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The L2 norm of all of `grads` as whole tensors (see the module docstring), as a 0-dim fp32 tensor,
    identical on every rank. Plain tensors are whole unless `group` is given, in which case they are
    disjoint pieces whose squares are summed over `group`."""
    whole: list[torch.Tensor] = []
    by_group: dict[int, tuple[dist.ProcessGroup | None, list[torch.Tensor]]] = {}
    per_tensor: list[torch.Tensor] = []  # DTensors on meshes this module does not reduce itself
    for g in grads:
        if isinstance(g, DTensor):
            placements = g.placements
            if all(isinstance(p, Replicate) for p in placements):
                whole.append(g.to_local())
            elif g.device_mesh.ndim == 1:
                pg = g.device_mesh.get_group()
                by_group.setdefault(id(pg), (pg, []))[1].append(g.to_local())
            else:
                per_tensor.append(g)
        elif group is not None:
            by_group.setdefault(id(group), (group, []))[1].append(g)
        else:
            whole.append(g)
    device = next((_local(g).device for g in grads), torch.device("cpu"))
    total = _sum_of_squares([t for t in whole if t.numel()], device)
    for pg, tensors in by_group.values():
        square = _sum_of_squares([t for t in tensors if t.numel()], device)
        if comm.get_world_size(pg) > 1:  # a one-rank group (an expert-data-parallel group at ep = dp) sums nothing
            comm.all_reduce(square, op=comm.ReduceOp.SUM, group=pg)
        total = total + square
    for g in per_tensor:
        norm = torch.linalg.vector_norm(g, dtype=_ACCUMULATE).full_tensor()
        total = total + norm.pow(2)
    return total.sqrt()


def split_global_norm(dense: Sequence[torch.Tensor],
                      experts: Sequence[tuple[dist.ProcessGroup, Sequence[torch.Tensor]]] = ()) -> torch.Tensor:
    """`global_norm` over dense gradients and expert gradients together. `experts` holds one
    `(ep_group, tensors)` pair per expert-parallel degree the model uses (moe/groups.py): each pair's
    squares (each rank's own experts, reduced over their shard group as `global_norm` does) are summed over
    its expert-parallel group too, since each ep rank of it holds different experts. Empty: no experts."""
    total = global_norm(list(dense)).pow(2)
    for ep_group, tensors in experts:
        square = global_norm(list(tensors)).pow(2)
        comm.all_reduce(square, op=comm.ReduceOp.SUM, group=ep_group)
        total = total + square
    return total.sqrt()


def tensor_parallel_norm(norm: float, shards: Sequence[torch.Tensor], tp_group: dist.ProcessGroup | None) -> float:
    """The whole-model norm under tensor parallelism (engine/autotp.py), from `norm`, the norm a strategy
    took with every tensor parallel rank's `shards` (the split parameters' gradients, in the form the
    strategy holds them) counted as if they were whole: their squares S are replaced by the sum of S over
    `tp_group`. Every rank of the tp group gets the same value; an inf/nan on any of them makes it
    nonfinite everywhere (the overflow agreement across the group)."""
    if tp_group is None:
        return norm
    local = global_norm(list(shards)).pow(2) if shards else torch.zeros((), dtype=_ACCUMULATE)
    total = local.clone()
    comm.all_reduce(total, op=comm.ReduceOp.SUM, group=tp_group)
    squared = norm * norm - float(local.item()) + float(total.item())
    if squared != squared or squared == float("inf"):  # nan/inf: an overflow on some rank
        return squared
    return max(squared, 0.0) ** 0.5  # rounding can leave a tiny negative when the shards are ~0


def clip_by_global_norm_(
    grads: Sequence[torch.Tensor], max_norm: float, group: dist.ProcessGroup | None = None
) -> float:
    """Scale `grads` in place so their global L2 norm is at most `max_norm` (torch's rule:
    `min(1, max_norm / (norm + 1e-6))`; `max_norm <= 0` means no clipping). Returns the pre-clip norm
    as a python float, identical on every rank. `group` as in `global_norm`."""
    grads = list(grads)
    value = float(global_norm(grads, group).item())
    clip_to_norm_(grads, max_norm, norm=value)
    return value


def clip_to_norm_(grads: Sequence[torch.Tensor], max_norm: float, *, norm: float) -> None:
    """The scaling of `clip_by_global_norm_` for a global norm already computed (`norm`, identical on
    every rank): a strategy that took the norm in `finish_gradients` to learn whether any gradient is
    inf/nan (a nonfinite element makes the norm nonfinite on every rank, so the all-reduce of the
    squares is also the overflow agreement) clips with it, without a second reduction."""
    locals_ = [t for t in map(_local, grads) if t.numel()]
    if max_norm > 0 and locals_:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            torch._foreach_mul_(locals_, coef)
