"""The experts of one MoE layer held by this rank, and their computation. Caller: `moe/layer.py`.

As in DeepSpeed, every expert is a deep copy of the user's `expert` module, held in
`deepspeed_experts`, and each parameter is marked `allreduce = False` with `group_name = "ep_size_<n>"`
(what `moe/utils.py` and DeepSpeed scripts read). Unlike DeepSpeed the container is keyed by *global*
expert id: rank r of an ep group of size n holds experts r * L .. r * L + L - 1 under those names
(`bind` re-keys them when the engine places the layer on the mesh), so a parameter's name means the
same expert at every `ep_size`; checkpoints store each expert once under that name and a run resumes at
another `ep_size` or world size through the ordinary resharding load.

Computation: rows arrive expert-major with per-expert counts. The reference (and CPU) path loops over
the local experts on their row segments; on CUDA, experts that are `Linear -> activation -> Linear`
stacks run as two `torch._grouped_mm` calls over stacked weights (measured on CPU it is no faster than
the loop at these sizes, so it is used only on GPU; tests compare it with the loop on CPU).

Gradient scale: the expert-data-parallel group (ranks holding the same experts) has dp / ep ranks, and
every ZeRO strategy averages a gradient over the group it reduces over. An expert's gradient already
sums the contributions of the ep ranks whose tokens it served, so the right mean over all dp ranks'
losses needs a further 1 / ep; `grad_scale` applies it, so the strategies need no MoE case. Gradients
are linear in the gradient that flows in, so scaling the experts' output gradient by s and their input
gradient by 1 / s scales every expert parameter's gradient by s and leaves the tokens' gradient as it
was: two elementwise multiplications of the rows per layer, instead of one autograd node per expert
weight (exact for s a power of two, as with ep_size 2, 4, 8).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:  # noqa: ANN001
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return grad * ctx.scale, None


def _is_mlp(module: nn.Module) -> bool:
    return (isinstance(module, nn.Sequential) and len(module) == 3 and isinstance(module[0], nn.Linear)
            and isinstance(module[2], nn.Linear) and not any(True for _ in module[1].parameters()))


class Experts(nn.Module):
    """`num_local_experts` copies of `expert`; `forward(rows (N, d), counts [L]) -> (N, d_out)`."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.deepspeed_experts = nn.ModuleDict(
            {str(i): copy.deepcopy(expert) for i in range(num_local_experts)}
        )
        self.first_expert = 0  # global id of local expert 0
        self.grad_scale = 1.0
        self.grouped = _is_mlp(expert)
        for module in self.deepspeed_experts.values():
            for p in module.parameters():
                p.allreduce = False
                p.group_name = expert_group_name

    def bind(self, *, ep_rank: int, ep_size: int) -> None:
        """Re-key the local experts to their global ids on ep rank `ep_rank` and set the gradient scale.
        Called once, before any strategy wraps the model."""
        first = ep_rank * self.num_local_experts
        if first != self.first_expert:
            modules = list(self.deepspeed_experts.values())
            self.deepspeed_experts = nn.ModuleDict({str(first + i): m for i, m in enumerate(modules)})
            self.first_expert = first
        self.grad_scale = 1.0 / ep_size

    def forward(self, rows: Tensor, counts: list[int]) -> Tensor:
        scale = self.grad_scale
        if scale != 1.0:
            rows = _ScaleGrad.apply(rows, 1.0 / scale)  # the tokens' gradient back at its own scale
        experts = list(self.deepspeed_experts.values())
        if self.grouped and rows.is_cuda and hasattr(torch, "_grouped_mm"):
            out = self._grouped(rows, counts, experts)
        else:
            out = self.reference(rows, counts)
        return _ScaleGrad.apply(out, scale) if scale != 1.0 else out  # expert gradients times grad_scale

    def reference(self, rows: Tensor, counts: list[int]) -> Tensor:
        """Loop over local experts on their segments of `rows` (the specification and the CPU path);
        gradients unscaled (`forward` applies `grad_scale`)."""
        outs = []
        for expert, chunk in zip(self.deepspeed_experts.values(), rows.split(counts), strict=True):
            out = expert(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs) if outs else rows

    @staticmethod
    def _weights(experts: list[nn.Module], index: int) -> tuple[Tensor, Tensor | None]:
        w = torch.stack([e[index].weight for e in experts]).transpose(1, 2)  # (L, in, out)
        b = torch.stack([e[index].bias for e in experts]) if experts[0][index].bias is not None else None
        return w, b

    def _grouped(self, rows: Tensor, counts: list[int], experts: list[nn.Module]) -> Tensor:
        """Linear -> act -> Linear over all local experts with two grouped GEMMs."""
        offs = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        owner = torch.repeat_interleave(torch.arange(len(counts), device=rows.device),
                                        torch.tensor(counts, device=rows.device))  # (N,) expert per row
        w1, b1 = self._weights(experts, 0)
        h = torch._grouped_mm(rows, w1.to(rows.dtype), offs=offs)  # (N, hidden)
        if b1 is not None:
            h = h + b1.to(h.dtype)[owner]
        h = experts[0][1](h)
        w2, b2 = self._weights(experts, 2)
        out = torch._grouped_mm(h.contiguous(), w2.to(h.dtype), offs=offs)  # (N, d_out)
        return out + b2.to(out.dtype)[owner] if b2 is not None else out
