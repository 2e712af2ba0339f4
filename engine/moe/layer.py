"""`MoE`, DeepSpeed's Mixture-of-Experts layer at its own path (`deepfleet.engine.moe.layer.MoE`):
`forward(hidden_states) -> (output, l_aux, exp_counts)`. Used by user models (and the example MoE GPT);
the engine places it on the mesh in `initialize` (`moe/groups.py`).

One forward over T = batch * seq tokens of width d, E experts, L = E / ep_size local, top-k:
  gate (moe/gating.py)            x (T, d) -> topk_idx, gates (T, k), capacity C or dropless
  route (moe/dispatch.py)         row_map (T, k): each kept assignment's row, -1 if dropped
  permute (kernels/moe_permute)   (E * C, d) padded, or (T * k, d) compact when dropless
  ep > 1: all-to-all              rows of this rank's L experts, expert-major
  experts (moe/experts.py)        same rows, expert outputs
  ep > 1: all-to-all back, then unpermute: out[t] = sum_j gates[t, j] * y[row_map[t, j]]
`use_residual` (Residual MoE): output = moe * c0 + mlp(x) * c1 with c = softmax(coefficient(x)), where
mlp is the `expert` module itself (a dense branch every token takes).

Parameter names are DeepSpeed's (`deepspeed_moe.gate.wg.weight`,
`deepspeed_moe.experts.deepspeed_experts.<id>.*`, with global expert ids, see moe/experts.py), so
DeepSpeed MoE checkpoints' module state maps by name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deepfleet.engine.moe.dispatch import ExpertParallelDispatch, permute_rows, route
from deepfleet.engine.moe.experts import Experts
from deepfleet.engine.moe.gating import TopKGate, renormalize
from deepfleet.kernels.moe_permute import moe_unpermute


class MOELayer(nn.Module):
    """Gate + experts + dispatch; `forward(x (T, d)) -> (T, d)`, setting `l_aux` and `exp_counts`."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int,
                 num_local_experts: int) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group_name, self.ep_size, self.num_local_experts = ep_group_name, ep_size, num_local_experts
        self.ep_group: Any = None  # set by moe/groups.py (bind_expert_parallel) when ep_size > 1
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None
        self.last_send_rows = 0  # rows this rank sent to experts in the last forward (benchmarks)

    def set_ep_group(self, group: Any, *, ep_rank: int) -> None:
        """Place the layer: `group` is its expert-parallel process group, `ep_rank` this rank's index."""
        self.ep_group = group
        self.experts.bind(ep_rank=ep_rank, ep_size=self.ep_size)

    def forward(self, x: Tensor) -> Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"MoE(ep_size={self.ep_size}) has no expert-parallel group yet; pass the model to "
                "deepfleet.engine.initialize (it places MoE layers on the mesh) before the first forward"
            )
        r = self.gate(x)
        num_experts, k = self.gate.num_experts, self.gate.k
        row_map, kept = route(r.topk_idx, num_experts=num_experts, capacity=r.capacity, priority=r.priority)
        gates = renormalize(r.gates, row_map >= 0, k=k)  # (T, k)
        num_rows = num_experts * r.capacity if r.capacity is not None else row_map.numel()
        permuted = permute_rows(x, row_map, num_rows)  # (rows, d)
        self.last_send_rows = num_rows
        if self.ep_size > 1:
            dispatch = ExpertParallelDispatch(self.ep_group, ep_size=self.ep_size,
                                              num_local_experts=self.num_local_experts, capacity=r.capacity)
            rows, counts = dispatch.to_experts(permuted, kept)
            y = dispatch.to_tokens(self.experts(rows, counts))
        else:
            counts = [r.capacity] * num_experts if r.capacity is not None else kept.tolist()
            y = self.experts(permuted, counts)
        self.l_aux, self.exp_counts = r.l_aux, r.exp_counts
        return moe_unpermute(y, row_map, gates.to(torch.float32))


class MoE(nn.Module):
    """DeepSpeed's `MoE` layer (module docstring). Extra keyword-only argument:
    `bias_update_rate` (> 0: auxiliary-loss-free bias balancing, see moe/gating.py)."""

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        *,
        bias_update_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if ep_size < 1 or num_experts < 1 or num_experts % ep_size:
            raise ValueError(
                f"num_experts: {num_experts} is not a multiple of ep_size {ep_size}; each expert-parallel "
                "rank holds num_experts / ep_size experts, so pick num_experts divisible by ep_size"
            )
        if enable_expert_tensor_parallelism:
            raise ValueError("enable_expert_tensor_parallelism: tensor-parallel experts are not supported; "
                             "drop the argument")
        # use_tutel names an optional CUDA library; the permutation kernels here do that job.
        self.use_tutel = use_tutel
        self.use_residual = use_residual
        self.ep_size, self.num_experts = ep_size, num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling,
                        bias_update_rate=bias_update_rate)
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, self.expert_group_name, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(output shaped like hidden_states, l_aux (), exp_counts (num_experts,))."""
        if used_token is not None:
            raise ValueError("used_token: masking tokens out of routing is not supported; pass None")
        d = hidden_states.shape[-1]
        x = hidden_states.reshape(-1, d)  # (T, d)
        out = self.deepspeed_moe(x)
        if self.use_residual:
            dense = self.mlp(x)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(x), dim=-1)  # (T, 2)
            out = out * coef[:, 0:1] + dense * coef[:, 1:]
        return out.reshape(hidden_states.shape), self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
