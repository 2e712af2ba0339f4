"""Tied weights across pipeline stages (DeepSpeed's TiedLayerSpec): one group per tie, equal copies at
start, summed gradients at every step.

Called by `engine/pipe/engine.py`: `TiedWeights.build(...)` at `initialize` (after the mesh, before the
ZeRO strategy takes its fp32 masters, so the masters start equal), `allreduce_grads` after the strategy
has reduced gradients over data parallelism. Reducing after the data-parallel reduction is the same sum
(both are linear) and works at every ZeRO stage: the tensors reduced are the optimizer's gradient
tensors — whole at stage 0, this rank's rows of the same dim-0 layout at stages 1/2 — and the stages
holding a tie have the same data-parallel width, so their rows line up.

A tie's group holds, for each data-parallel coordinate, the ranks of the stages that use it; every rank
creates every group (torch's rule for `new_group`), in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from deepfleet.engine import comm


def _get(module: torch.nn.Module, dotted: str) -> torch.Tensor:
    value: Any = module
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


@dataclass
class TiedWeights:
    """The ties this rank holds: (key, group, owner flag, parameters)."""

    ties: list[tuple[str, Any, bool, list[torch.nn.Parameter]]] = field(default_factory=list)

    @classmethod
    def build(cls, model: Any, *, mesh_ranks: torch.Tensor, rank: int) -> TiedWeights:
        """`mesh_ranks`: the mesh's global ranks, shape (pp, rest). Broadcasts each tie from its first stage."""
        out = cls()
        columns = mesh_ranks.reshape(mesh_ranks.shape[0], -1)
        for key, stages in sorted(model.tied_stages().items()):
            if len(stages) < 2:
                continue
            for c in range(columns.shape[1]):
                ranks = [int(columns[s, c]) for s in stages]
                group = comm.new_group(ranks)
                if rank in ranks and key in model.tied_modules:
                    module = model.tied_modules[key]
                    params = [_get(module, attr) for attr in model.tied_weight_attrs[key]]
                    out.ties.append((key, group, rank == ranks[0], params))
        with torch.no_grad():
            for _, group, _, params in out.ties:
                for p in params:
                    comm.broadcast(p.detach(), group=group, group_src=0)
        return out

    def tied_params(self) -> list[torch.nn.Parameter]:
        return [p for _, _, _, params in self.ties for p in params]

    def non_owned(self) -> set[int]:
        """ids of tied parameters whose gradient norm another stage counts (clipping counts a tie once)."""
        return {id(p) for _, _, owner, params in self.ties if not owner for p in params}

    def allreduce_grads(self, grads: dict[int, torch.Tensor | None]) -> None:
        """Sum each tied parameter's gradient tensor (`grads`: id(param) -> the optimizer's grad for it)
        over its tie's group."""
        for _, group, _, params in self.ties:
            for p in params:
                g = grads.get(id(p))
                if g is None:
                    continue
                local = g.to_local() if isinstance(g, DTensor) else g
                comm.all_reduce(local, group=group)
