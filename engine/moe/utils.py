"""DeepSpeed's MoE parameter helpers at their path (`deepfleet.engine.moe.utils`), for user scripts, and
`place_expert_param_groups`, which `engine/build.py` applies to every run's param groups.

An expert parameter is one with `allreduce = False` (set by `moe/experts.py`, DeepSpeed's marker) and a
`group_name`. `split_params_into_different_moe_groups_for_optimizer` moves expert parameters out of each
group into groups of their own (`{**group, "name": group_name, "moe": True}`), as DeepSpeed's does,
so optimizers see the same groups; `place_expert_param_groups` then gives each such group the
`"process_group"` its gradients reduce over (the expert-data-parallel group, `moe/groups.py`), which is
how every ZeRO strategy learns that experts are data parallel over fewer ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepfleet.engine.moe.groups import expert_groups, moe_layers


def is_moe_param(param: torch.Tensor) -> bool:
    """True for an expert parameter (DeepSpeed's `allreduce = False` marker)."""
    return getattr(param, "allreduce", True) is False


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """(whether `model` has MoE layers, the number of experts of the last one), as DeepSpeed answers."""
    layers = moe_layers(model)
    return bool(layers), (layers[-1].gate.num_experts if layers else 0)


def split_params_into_shared_and_expert_params(params: list[torch.Tensor]) -> tuple[list, list]:
    """(dense parameters, expert parameters) of `params`, order kept."""
    shared = [p for p in params if not is_moe_param(p)]
    return shared, [p for p in params if is_moe_param(p)]


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: Any = None) -> list[dict]:
    """Move the expert parameters of every group into their own group per `group_name` (after all the
    dense groups), keeping the group's hyper-parameters; `max_group_size` is accepted for DeepSpeed's
    signature (groups are never split by size here). A dict, tuple or list of group dicts."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"param_groups: expected a dict or a list of dicts, got {type(param_groups).__name__}")
    moe_groups: list[dict] = []
    for group in param_groups:
        params = list(group["params"]) if not isinstance(group["params"], torch.Tensor) else [group["params"]]
        by_name: dict[str, list] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(getattr(p, "group_name", None) or "experts", []).append(p)
        group["params"] = [p for p in params if not is_moe_param(p)]
        for name, tensors in by_name.items():
            moe_groups.append({**group, "name": name, "moe": True, "params": tensors})
    return param_groups + moe_groups


def is_moe_param_group(param_group: dict) -> bool:
    return bool(param_group.get("moe", False))


def place_expert_param_groups(groups: list[dict]) -> list[dict]:
    """`groups` with expert parameters in groups of their own (at every ep_size, so the optimizer's
    groups, and its checkpointed state, look the same whatever the ep_size), each bound group carrying
    `"process_group"` (the expert-data-parallel group). Unchanged without expert parameters."""
    if not any(is_moe_param(p) for g in groups for p in g["params"]):
        return groups
    out = []
    for group in split_params_into_different_moe_groups_for_optimizer([{**g} for g in groups]):
        placed = [expert_groups(p) for p in group["params"]]
        if group.get("moe") and placed and placed[0] is not None:
            group = {**group, "process_group": placed[0].dp_group}
        if group["params"] or not group.get("moe"):
            out.append(group)
    return out
