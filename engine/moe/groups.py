"""Placing MoE layers on the mesh: the expert-parallel degree a model asks for, and the process groups
each expert parameter carries. Called by `engine.initialize` (`model_ep_size` before the degrees are
checked, `bind_expert_parallel` after the mesh exists and before any strategy wraps the model), and read
by the ZeRO strategies and `moe/utils.py` through `expert_groups(param)`.

Groups come from `engine/parallel.py`'s mesh: the `ep` sub-mesh (ranks that exchange tokens, consecutive
data-parallel ranks, as DeepSpeed lays them out by default) and `dp_mod_ep` (ranks that hold the same
experts: the expert-data-parallel group their gradients reduce over). With ep_size 1 nothing is bound and
expert parameters are ordinary data-parallel parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from deepfleet.engine import comm

ATTR = "expert_groups"  # the attribute bind_expert_parallel sets on every expert parameter


@dataclass(frozen=True)
class ExpertGroups:
    """The process groups of one expert parameter (ep_size > 1)."""

    ep_group: Any  # ranks exchanging tokens; an expert's gradient norm is summed over it
    ep_size: int
    dp_group: Any  # expert-data-parallel: ranks holding the same experts (gradients reduce over it)
    dp_size: int


def moe_layers(model: nn.Module) -> list[Any]:
    """Every `MOELayer` in `model`, in module order."""
    from deepfleet.engine.moe.layer import MOELayer

    return [m for m in model.modules() if isinstance(m, MOELayer)]


def model_ep_size(model: nn.Module, configured: int | None = None) -> int | None:
    """The one ep_size of the model's MoE layers (None without any), checked against `moe.ep_size`
    when the config sets it. Raises ValueError naming the argument and the fix."""
    sizes = sorted({layer.ep_size for layer in moe_layers(model)})
    if len(sizes) > 1:
        raise ValueError(f"MoE(ep_size=...): the model's layers use ep_size {sizes}; use one ep_size in every layer")
    found = sizes[0] if sizes else None
    if configured is not None and found is not None and configured != found:
        raise ValueError(f"moe.ep_size: {configured} but the model's MoE layers use ep_size {found}; make them agree")
    return found if found is not None else configured


def bind_expert_parallel(model: nn.Module, parallel: Any) -> None:
    """Give every MoE layer its ep group and global expert ids, and every expert parameter its
    `ExpertGroups` (no-op at ep 1). `parallel` is the engine's `ParallelDims`, mesh built."""
    layers = moe_layers(model)
    if not layers or parallel.ep == 1:
        return
    ep_mesh, edp_mesh = parallel.submesh("ep"), parallel.submesh("dp_mod_ep")
    groups = ExpertGroups(ep_mesh.get_group(), parallel.ep, edp_mesh.get_group(), parallel.dp_size // parallel.ep)
    ep_rank = ep_mesh.get_local_rank()
    for layer in layers:
        layer.set_ep_group(groups.ep_group, ep_rank=ep_rank)
        for p in layer.experts.parameters():
            setattr(p, ATTR, groups)
    assert comm.get_world_size(groups.ep_group) == parallel.ep


def expert_groups(param: Any) -> ExpertGroups | None:
    """The groups `bind_expert_parallel` gave `param`, None for a dense parameter (or at ep 1)."""
    return getattr(param, ATTR, None)
