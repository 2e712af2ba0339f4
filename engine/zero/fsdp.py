"""ZeRO stage 3: parameters, gradients and optimizer state sharded, on FSDP2 (`fully_shard`).

Built by `engine/build.py` for `zero_optimization.stage = 3`. Each transformer block (`engine/blocks.py`)
becomes its own FSDP unit, then the root: a block's parameters are all-gathered just
before it runs and freed after, and its gradients are reduce-scattered as backward leaves it. Parameters
become `DTensor`s sharded on dim 0, so the optimizer steps on the local shards directly and the state
dict from `get_state_dict` already has the layout `ZeroStrategy.state_dict()` promises.

On gloo each unit's gradient reduce-scatter runs as a ring of point-to-point sends over FSDP2's own
rank-major buffer (`zero/fsdp_collectives.py`), 3.5x faster than gloo's reduce-scatter. Blocks reshard
after forward (FSDP2's default; the root stays gathered), so model states stay near the ZeRO-3 ideal of
16P/N bytes through the step; keeping blocks gathered until backward, as DeepSpeed does at its default
`stage3_max_reuse_distance`, would save one all-gather per block per step for 4P bytes more mid-step.

Gradient accumulation follows DeepSpeed's stage 3: every micro-step reduce-scatters, and FSDP2 adds
each micro-step's shard into the sharded gradient, so no unsharded gradient outlives its unit's backward
(model states stay near 16P/N through the window). `zero_optimization.deepfleet_local_grad_accumulation`
(deepfleet's own key, with the meaning it has at stage 2) turns FSDP2's gradient sync off on
non-boundary micro-steps instead: unsharded gradients (4P bytes) accumulate locally and only the
boundary micro-step communicates, 1/gradient_accumulation_steps of the gradient traffic.

16-bit training uses FSDP2's `MixedPrecisionPolicy`: the fp32 shards are the master weights, each
all-gather casts to the compute dtype, and gradients are reduced in fp32 (gloo would sum bf16 in bf16).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from deepfleet.engine import comm
from deepfleet.engine.blocks import shard_units
from deepfleet.engine.moe.groups import expert_groups, moe_layers
from deepfleet.engine.zero.construction import adopt_into_fsdp, partitioned_params
from deepfleet.engine.zero.fsdp_collectives import CompressedReduceScatter, RingReduceScatter
from deepfleet.engine.zero.gradients import clip_to_norm_, split_global_norm


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FSDPStrategy:
    """Stage 3 (see module docstring)."""

    _norm: float | None = None  # the global gradient norm finish_gradients took (clip_grad_norm_ uses it)

    def __init__(
        self,
        model: nn.Module,
        *,
        compute_dtype: torch.dtype,
        zero_config: Any,
        process_group: Any = None,
    ) -> None:
        self._group = process_group or dist.group.WORLD
        # fully_shard swaps in new (DTensor) parameters under the same FQNs; remember the user's
        # tensors by FQN so their param groups can be mapped onto the shards.
        self._name_of = {id(p): name for name, p in model.named_parameters()}
        device = next(model.parameters()).device
        mesh = DeviceMesh.from_group(self._group, device.type)
        if compute_dtype == torch.float32:
            policy = MixedPrecisionPolicy()
        else:
            policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        self._ep: list[tuple[Any, set[str]]] = []  # per expert-parallel degree: its groups, its FQNs
        self._expert_names: set[str] = set()

        def shard() -> None:
            # Experts on an expert-parallel mesh are FSDP units of their own, sharded over their
            # expert-data-parallel group (the ranks holding the same experts); the enclosing block's and the
            # root's units then leave their parameters alone.
            for layer in moe_layers(model):
                groups = next((expert_groups(p) for p in layer.experts.parameters()), None)
                if groups is None:
                    continue
                names = {name for name, p in model.named_parameters() if expert_groups(p) is groups}
                if not any(g is groups for g, _ in self._ep):
                    self._ep.append((groups, names))
                self._expert_names |= names
                fully_shard(layer.experts, mesh=DeviceMesh.from_group(groups.dp_group, device.type), mp_policy=policy)
                if groups.dp_size > 1 and dist.get_backend(groups.dp_group) == "gloo":
                    layer.experts.set_custom_reduce_scatter(RingReduceScatter())
            units = shard_units(model)  # transformer blocks; a ZeRO-3 leaf module holding blocks replaces them
            for block in units:
                fully_shard(block, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            if dist.get_backend(self._group) == "gloo":
                # Gloo's reduce-scatter is 3.5x slower than a ring of sends (see zero/fsdp_collectives.py);
                # the hook also hands the buffer to a gradient compression policy first.
                for unit in [*units, model]:
                    unit.set_custom_reduce_scatter(RingReduceScatter())
            elif comm.gradient_policy() is not None:  # installed by build.py before the strategy is built
                for unit in [*units, model]:
                    unit.set_custom_reduce_scatter(CompressedReduceScatter())
        if partitioned_params(model):  # built under deepspeed.zero.Init: never whole (zero/construction.py)
            adopt_into_fsdp(model, shard, group=self._group)
        else:
            shard()
        self.module = model
        self.local_accumulation = bool(getattr(zero_config, "deepfleet_local_grad_accumulation", False))
        self._params = dict(model.named_parameters())
        self._optimizer: torch.optim.Optimizer | None = None

    def optimizer_param_groups(self, groups: list[dict]) -> list[dict]:
        out = []
        for i, group in enumerate(groups):
            shards = []
            for p in group["params"]:
                name = self._name_of.get(id(p))
                if name is None:
                    raise ValueError(
                        f"model_parameters[{i}]: a tensor that is not a parameter of the model; "
                        "pass model.parameters() or groups over them"
                    )
                shards.append(self._params[name])
            out.append({**{k: v for k, v in group.items() if k != "process_group"}, "params": shards})
        return out

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer

    def set_gradient_sync(self, enabled: bool) -> None:
        # Read by FSDP2 in backward. By default every micro-step reduce-scatters (DeepSpeed's stage-3
        # semantics): FSDP2 adds each micro-step's reduced shard into the sharded p.grad, so no
        # unsharded gradient outlives its unit's backward. With local accumulation, non-boundary
        # micro-steps keep FSDP2's unsharded gradients instead (4P bytes through the window).
        self.module.set_requires_gradient_sync(enabled or not self.local_accumulation)

    def _local_grads(self) -> list[torch.Tensor]:
        return [_local(p.grad) for p in self._params.values() if p.grad is not None]

    def finish_gradients(self, *, grad_scale: float) -> bool:
        # FSDP2 waits for its reduce-scatters at the end of backward: the shards hold averaged grads.
        grads = self._local_grads()
        if grads and grad_scale != 1.0:
            torch._foreach_div_(grads, grad_scale)
        # The global norm is needed anyway (clip_grad_norm_ reports it); it is nonfinite on every rank
        # exactly when some rank's shards hold inf/nan, so its all-reduce is also the overflow agreement
        # (zero/gradients.py): no separate pass over every gradient and no extra collective.
        self._norm = self._global_norm()
        return not math.isfinite(self._norm)

    def _global_norm(self) -> float:
        # DTensor shards: their squares are summed over each mesh (one all-reduce per mesh); expert
        # shards' squares also over the expert-parallel group (each ep rank holds other experts).
        dense = [p.grad for n, p in self._params.items() if p.grad is not None and n not in self._expert_names]
        expert = [(groups.ep_group, [p.grad for n, p in self._params.items() if p.grad is not None and n in names])
                  for groups, names in self._ep]
        return float(split_global_norm(dense, expert).item())

    def clip_grad_norm_(self, max_norm: float) -> float:
        norm = self._norm if self._norm is not None else self._global_norm()  # finish_gradients took it
        self._norm = None
        clip_to_norm_([p.grad for p in self._params.values() if p.grad is not None], max_norm, norm=norm)
        return norm

    def after_optimizer_step(self) -> None:
        """Nothing to publish: the next forward all-gathers (and casts) the updated shards."""

    def zero_grad(self) -> None:
        self._norm = None
        for p in self._params.values():
            p.grad = None

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        optimizer_state = []
        if self._optimizer is not None:
            for state in self._optimizer.state.values():
                optimizer_state.extend(_local(v) for v in state.values() if isinstance(v, torch.Tensor))
        return {
            "params": [_local(p) for p in self._params.values()],
            "grads": self._local_grads(),
            "optimizer": optimizer_state,
            "master": [],
        }

    def state_dict(self) -> dict:
        model, optim = get_state_dict(self.module, self._optimizer if self._optimizer is not None else [])
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict) -> None:
        optimizers = self._optimizer if self._optimizer is not None else []
        set_state_dict(
            self.module,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim") or {},
        )
