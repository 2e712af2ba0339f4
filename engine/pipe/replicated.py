"""ZeRO stage 0 for pipeline stages: replicated parameters, gradients averaged over the data-parallel
group once per step, in one flat all-reduce.

Used by `engine/pipe/engine.py` in place of `zero/ddp.py`'s DDP strategy (handed to `build_training`).
Why not DDP: torch's pipeline stage drives DDP only when the DDP module is the stage's own module, and
DDP's bucket rebuild fails on torch 2.13 when one step runs several backward passes (GPipe: "rebuilt
parameter indices size is not same as original model parameters size"); running the chunks outside
DDP would keep DDP's bucket buffers (a second copy of every gradient) allocated and unused. A pipeline
step has all its backward passes inside `train_batch`, so there is no overlap to lose that DDP's
bucketing would buy beyond the last micro-batch. Everything else (fp32 masters in 16-bit mode, state
dicts, clipping) is the DDP strategy's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepfleet.engine import comm
from deepfleet.engine.zero.ddp import DDPStrategy, _HookState


class ReplicatedStrategy(DDPStrategy):
    """Stage 0 without DDP (see the module docstring)."""

    def __init__(self, model: nn.Module, *, compute_dtype: torch.dtype, zero_config: Any,
                 process_group: Any = None) -> None:
        self._model = model
        self._group = process_group
        self._world_size = comm.get_world_size(process_group)
        self._names = [name for name, p in model.named_parameters() if p.requires_grad]
        params = [p for p in model.parameters() if p.requires_grad]
        with torch.no_grad():  # every replica starts from its group rank 0's weights, as DDP does
            for t in [*params, *model.buffers()]:
                comm.broadcast(t.detach(), group=process_group, group_src=0)
        if compute_dtype == torch.float32:
            self._masters = params
        else:
            self._masters = [p.detach().clone().float() for p in params]
            model.to(compute_dtype)
        self._params = params
        self._master_of = {id(p): m for p, m in zip(params, self._masters, strict=True)}
        self._experts: list[int] = []  # MoE expert groups are not composed with pipelining here
        self._ep: list = []
        self._hook_state = _HookState(process_group, self._world_size)
        self.module = model
        self._optimizer = None

    def set_gradient_sync(self, enabled: bool) -> None:
        """Gradients are reduced once, in `finish_gradients`."""

    def finish_gradients(self, *, grad_scale: float) -> bool:
        grads = [p.grad for p in self._params if p.grad is not None]
        if grads and self._world_size > 1:
            # averaged in fp32 (gloo sums 16-bit values in 16 bits)
            flat = torch._utils._flatten_dense_tensors([g.float() for g in grads])
            comm.all_reduce(flat, op=comm.ReduceOp.AVG, group=self._group)
            for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
                g.copy_(reduced)
        return super().finish_gradients(grad_scale=grad_scale)
