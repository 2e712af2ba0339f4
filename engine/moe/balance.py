"""Auxiliary-loss-free load balancing (DeepSeek-V3's bias update) as a step sink: after every optimizer
step, each gate with `bias_update_rate > 0` sums its assignment counts over the data-parallel ranks and
moves its `expert_bias` (moe/gating.py). Built by `engine/build.py` (`bias_balancers`) and called by the
engine with each step's `StepMetrics`, on every rank in the same order, so its one all-reduce per step
lines up. Why a sink: the update belongs to the optimizer step boundary, which is exactly what the step
seam delivers, and the engine needs no MoE case.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepfleet.engine import comm
from deepfleet.engine.moe.groups import moe_layers


class ExpertBiasBalancer:
    """Updates the expert biases of `gates` once per optimizer step (counts summed over `group`)."""

    def __init__(self, gates: list[Any], *, group: Any) -> None:
        self.gates, self.group = gates, group

    def __call__(self, m: Any) -> None:
        counts = torch.cat([g.load_counts for g in self.gates])  # (layers * E,) one reduction for all
        comm.all_reduce(counts, group=self.group, log_name="moe_bias_counts")
        for gate, c in zip(self.gates, counts.split([g.num_experts for g in self.gates]), strict=True):
            gate.update_expert_bias(c)


def bias_balancers(model: nn.Module, *, process_group: Any) -> list[ExpertBiasBalancer]:
    """The balancer for the model's bias-balanced gates, or [] when none asks for it."""
    gates = [layer.gate for layer in moe_layers(model) if layer.gate.bias_update_rate > 0]
    return [ExpertBiasBalancer(gates, group=process_group)] if gates else []
