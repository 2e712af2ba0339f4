"""Optimizer state keyed by parameter FQN, the layout `ZeroStrategy.state_dict()` promises.

Used by strategies that hold the tensors the optimizer updates themselves (stage 0's fp32 masters),
where `torch.distributed.checkpoint.state_dict.get_state_dict` cannot help: it finds optimizer state
through the module's own parameters. The format is that helper's: `{"state": {fqn: {name: tensor}},
"param_groups": [{hyper-parameters..., "params": [fqn, ...]}]}`.
"""

from __future__ import annotations

import torch


def fqn_optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict:
    """The optimizer's state re-keyed by FQN; `names` maps id(tensor the optimizer updates) -> FQN."""
    state = {names[id(t)]: dict(s) for t, s in optimizer.state.items()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(t)] for t in g["params"]]}
        for g in optimizer.param_groups
    ]
    return {"state": state, "param_groups": groups}


def load_fqn_optimizer_state(
    optimizer: torch.optim.Optimizer, state: dict, tensors: dict[str, torch.Tensor]
) -> None:
    """Load FQN-keyed state (as made by `fqn_optimizer_state`) into `optimizer`, whose tensors are
    `tensors` (FQN -> tensor). Raises ValueError when the saved groups do not match the optimizer's."""
    index = {}
    for g in optimizer.param_groups:
        for t in g["params"]:
            index[id(t)] = len(index)
    position = {fqn: index[id(t)] for fqn, t in tensors.items() if id(t) in index}
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"optimizer state has {len(saved_groups)} param groups, the optimizer {len(optimizer.param_groups)}; "
            "build the optimizer with the same param groups as the run that saved it"
        )
    try:
        # Hyper-parameters from the checkpoint, members from the live optimizer: a group's member list
        # is this rank's own (with expert parallelism each rank holds other experts).
        groups = [{**g, "params": [index[id(t)] for t in live["params"]]}
                  for g, live in zip(saved_groups, optimizer.param_groups, strict=True)]
        per_index = {position[fqn]: s for fqn, s in state["state"].items()}
    except KeyError as e:
        raise ValueError(f"optimizer state names parameter {e.args[0]!r}, which this model lacks") from e
    optimizer.load_state_dict({"state": per_index, "param_groups": groups})


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-tensor state if it has none yet (before the first step), so a state
    dict taken as a load target has every tensor to load into: one step with zero gradients at lr 0,
    which leaves the tensors unchanged. Gradients already present are kept."""
    if optimizer.state:
        return
    tensors = [t for g in optimizer.param_groups for t in g["params"]]
    kept = [t.grad for t in tensors]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for t in tensors:
        t.grad = torch.zeros_like(t)
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        g["lr"] = lr
    for t, grad in zip(tensors, kept, strict=True):
        t.grad = grad
