"""Placing MoE layers on the mesh: the expert-parallel degree a model asks for, and the process groups
each expert parameter carries. Called by `engine.initialize` (`model_ep_sizes` before the degrees are
checked, `bind_expert_parallel` after the mesh exists and before any strategy wraps the model), and read
by the ZeRO strategies and `moe/utils.py` through `expert_groups(param)`.

Groups come from `engine/parallel.py`'s mesh: per expert-parallel degree e, the `ep` sub-mesh of e
(ranks that exchange tokens, consecutive data-parallel ranks, as DeepSpeed lays them out by default) and
its `dp_mod_ep` (ranks that hold the same experts: the expert-data-parallel group their gradients reduce
over). Layers of one model may use different ep_size values (DeepSpeed names each degree's groups
`ep_size_<e>`, the experts' `group_name`); every degree gets its own pair. A layer at ep_size 1 binds
nothing: its experts are ordinary data-parallel parameters.
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


def model_ep_sizes(model: nn.Module, configured: int | None = None) -> list[int]:
    """The distinct ep_size values of the model's MoE layers, ascending (empty without any), checked
    against `moe.ep_size` when the config sets it (then every layer must use it). Layers may use
    different values, as DeepSpeed allows: each degree gets its own groups (`bind_expert_parallel`).
    Raises ValueError naming the key and the fix."""
    sizes = sorted({layer.ep_size for layer in moe_layers(model)})
    if configured is not None and sizes and sizes != [configured]:
        used = sizes[0] if len(sizes) == 1 else sizes
        raise ValueError(f"moe.ep_size: {configured} but the model's MoE layers use ep_size {used}; make them "
                         "agree (or drop moe.ep_size when the layers use several)")
    return sizes or ([configured] if configured is not None else [])


def bind_expert_parallel(model: nn.Module, parallel: Any) -> None:
    """Give every MoE layer at ep_size > 1 its ep group and global expert ids, and each of its expert
    parameters the `ExpertGroups` of that degree (one object per degree, shared by its layers: the
    strategies group expert parameters by identity). Layers at ep_size 1 stay data parallel.
    `parallel` is the engine's `ParallelDims`, mesh built."""
    placed: dict[int, ExpertGroups] = {}
    for layer in moe_layers(model):
        if layer.ep_size == 1:
            continue
        groups = placed.get(layer.ep_size)
        if groups is None:
            ep_mesh, edp_mesh = parallel.expert_submeshes(layer.ep_size)
            groups = placed[layer.ep_size] = ExpertGroups(
                ep_mesh.get_group(), layer.ep_size, edp_mesh.get_group(), parallel.dp_size // layer.ep_size)
            assert comm.get_world_size(groups.ep_group) == layer.ep_size
        layer.set_ep_group(groups.ep_group, ep_rank=comm.get_rank(groups.ep_group))
        for p in layer.experts.parameters():
            setattr(p, ATTR, groups)


def expert_groups(param: Any) -> ExpertGroups | None:
    """The groups `bind_expert_parallel` gave `param`, None for a dense parameter (or at ep 1)."""
    return getattr(param, ATTR, None)


def by_expert_groups(items: Any) -> list[tuple[ExpertGroups, list[Any]]]:
    """`(groups, [item, ...])` per distinct `ExpertGroups` of `items`, a sequence of (param, item) pairs,
    in first-appearance order (the same on every rank); dense parameters are left out."""
    out: list[tuple[ExpertGroups, list[Any]]] = []
    for p, item in items:
        groups = expert_groups(p)
        if groups is None:
            continue
        bucket = next((b for g, b in out if g is groups), None)
        if bucket is None:
            out.append((groups, bucket := []))
        bucket.append(item)
    return out
