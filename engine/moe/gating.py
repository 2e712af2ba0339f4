"""The MoE router: `TopKGate` scores tokens against experts and decides, per token, which experts see
it, with which weight, and which assignments a capacity drops. Caller: `moe/layer.py` (`MOELayer`).

Behaviour follows DeepSpeed-MoE's gate (learned from its documentation and source, written anew):
- logits = x @ wg^T in fp32; gates = softmax(logits). `noisy_gate_policy="Jitter"` multiplies the
  input by U(1 - 1e-2, 1 + 1e-2) while training; `"RSample"` picks the experts on logits plus Gumbel
  noise (gate values still come from the clean softmax).
- k = 1: the argmax expert, gate = its probability (not renormalized). k = 2: the argmax, and a second
  expert chosen on logits + Gumbel noise when `top2_2nd_expert_sampling` (DeepSpeed's default); the two
  kept gates are renormalized to sum to 1. k > 2: the top-k probabilities, renormalized over the kept.
- capacity = max(ceil(tokens / experts * capacity_factor * k), min_capacity) (`eval_capacity_factor` in
  eval mode); without `drop_tokens` no assignment is ever dropped (the dispatch is dropless).
- Which assignments a full expert keeps: k = 1 with `use_rts` (random token selection) keeps a uniformly
  random subset; otherwise (k <= 2) every token's first choice outranks any second choice and earlier
  tokens outrank later ones; k > 2 keeps the highest-probability assignments (DeepSpeed's "probs" drop
  policy). The kept set and the slot order are `Routing.priority`, consumed by `moe/permute.py`.
- l_aux, the load-balancing loss: num_experts * sum_e(mean_prob_e * frac_first_choice_e) for k <= 2;
  for k > 2 the fraction counts all k choices and the product is divided by k. exp_counts: assignments
  per expert before any dropping.

Auxiliary-loss-free balancing (DeepSeek-V3's): with `bias_update_rate > 0` the gate keeps a per-expert
`expert_bias` buffer added to the scores only for choosing experts (gate values stay bias-free), counts
assignments while training, and `update_expert_bias(counts)` — called once per optimizer step by
`moe/balance.py`'s step sink with the counts summed over the data-parallel ranks — moves each bias by
`rate * sign(mean_load - load_e)`: overloaded experts become less attractive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


@dataclass
class Routing:
    """One forward's routing decisions over T local tokens, E experts, top-k."""

    topk_idx: Tensor  # (T, k) int64 chosen experts
    gates: Tensor  # (T, k) fp32 combine weights (0 where dropped)
    capacity: int | None  # rows per expert, None = dropless
    priority: Tensor | None  # (T, k) fp32 score, higher keeps first; None = slot-major token order
    l_aux: Tensor  # () fp32
    exp_counts: Tensor  # (E,) int64 assignments per expert before dropping


def capacity_for(tokens: int, num_experts: int, *, capacity_factor: float, k: int, min_capacity: int) -> int:
    """Rows each expert gets: ceil(tokens / experts * capacity_factor * k), at least min_capacity."""
    return max(math.ceil(tokens / num_experts * capacity_factor * k), min_capacity)


def _gumbel(shape: torch.Size, device: torch.device) -> Tensor:
    u = torch.rand(shape, device=device).clamp_(1e-20, 1.0)
    return -torch.log((-torch.log(u)).clamp_(min=1e-20))


class TopKGate(nn.Module):
    """The gate (module docstring); `forward(x (T, d)) -> Routing`. `wg` is DeepSpeed's parameter name."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
        *,
        bias_update_rate: float = 0.0,
    ) -> None:
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"k: {k} must be between 1 and num_experts ({num_experts})")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"noisy_gate_policy: {noisy_gate_policy!r} is not one of None, 'Jitter', 'RSample'"
            )
        if min_capacity < 0 or capacity_factor <= 0 or eval_capacity_factor <= 0:
            raise ValueError("capacity_factor/eval_capacity_factor must be > 0 and min_capacity >= 0")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.num_experts, self.k = num_experts, k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens, self.use_rts = drop_tokens, use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.bias_update_rate = float(bias_update_rate)
        if self.bias_update_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(num_experts))
            self.register_buffer("load_counts", torch.zeros(num_experts), persistent=False)

    def forward(self, x: Tensor) -> Routing:
        x32 = x.float()  # (T, d)
        if self.noisy_gate_policy == "Jitter" and self.training:
            x32 = x32 * torch.empty_like(x32).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = F.linear(x32, self.wg.weight.float())  # (T, E)
        probs = F.softmax(logits, dim=-1)
        choose = logits.detach()
        if self.noisy_gate_policy == "RSample" and self.training:
            choose = choose + _gumbel(choose.shape, choose.device)
        if self.bias_update_rate > 0:
            # Softmax is monotone per token, so adding the bias to the logits ranks like adding it to scores.
            choose = choose + self.expert_bias
        topk_idx = self._choose(choose)  # (T, k)
        tokens = x.shape[0]
        gates = probs.gather(1, topk_idx)  # (T, k)
        counts = torch.bincount(topk_idx.reshape(-1), minlength=self.num_experts)
        l_aux = self._aux_loss(probs, topk_idx)
        if self.bias_update_rate > 0 and self.training:
            self.load_counts += counts.to(self.load_counts.dtype)
        capacity = None
        if self.drop_tokens:
            factor = self.capacity_factor if self.training else self.eval_capacity_factor
            capacity = capacity_for(tokens, self.num_experts, capacity_factor=factor, k=self.k,
                                    min_capacity=self.min_capacity)
        priority = None
        if self.k == 1 and self.use_rts and capacity is not None:
            priority = torch.rand(tokens, 1, device=x.device)
        elif self.k > 2:
            priority = gates.detach()
        return Routing(topk_idx, gates, capacity, priority, l_aux, counts)

    def _choose(self, scores: Tensor) -> Tensor:
        if self.k == 2 and self.top2_2nd_expert_sampling and self.training:
            first = scores.argmax(dim=1, keepdim=True)  # (T, 1)
            noisy = scores + _gumbel(scores.shape, scores.device)
            second = noisy.scatter(1, first, float("-inf")).argmax(dim=1, keepdim=True)
            return torch.cat([first, second], dim=1)
        return scores.topk(self.k, dim=1).indices

    def _aux_loss(self, probs: Tensor, topk_idx: Tensor) -> Tensor:
        e = self.num_experts
        me = probs.mean(0)  # (E,) mean router probability
        chosen = topk_idx if self.k > 2 else topk_idx[:, :1]
        ce = F.one_hot(chosen, e).sum(1).float().mean(0)  # (E,) fraction of tokens choosing each expert
        l_aux = (me * ce).sum() * e
        return l_aux / self.k if self.k > 2 else l_aux

    @torch.no_grad()
    def update_expert_bias(self, counts: Tensor) -> None:
        """Move `expert_bias` towards balance from `counts` (E,), the assignments per expert since the
        last update summed over the data-parallel ranks, and reset the local counter."""
        load = counts.float()
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.load_counts.zero_()


def renormalize(gates: Tensor, kept: Tensor, *, k: int) -> Tensor:
    """Combine weights after dropping: zero where dropped; for k >= 2 the kept gates of a token are
    renormalized to sum to 1 (DeepSpeed's top-2/top-k), for k = 1 the probability stays as is."""
    gates = torch.where(kept, gates, 0.0)
    if k == 1:
        return gates
    return gates / gates.sum(1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
