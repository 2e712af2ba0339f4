"""ZeRO stage 0: plain data parallelism on torch's DistributedDataParallel.

Built by `engine/build.py` for `zero_optimization.stage = 0`. Every rank holds full parameters,
gradients and optimizer state; DDP all-reduces bucketed gradients during backward
(`gradient_as_bucket_view=True`, so gradients live in the buckets, no second copy), through a comm hook
that issues each bucket's all-reduce via `engine.comm`, so they are counted with every other collective.
On non-boundary micro-steps the engine turns sync off, which DDP reads when the forward starts (the
`no_sync` flag). A 1-bit optimizer (`engine/onebit/`) that averages compressed momentum itself tells the
hook, per step, to leave the gradients local (`bind_optimizer`).

16-bit training (bf16/fp16) keeps fp32 master weights here, as DeepSpeed does: the model runs in 16 bits,
the optimizer updates the fp32 masters, and `after_optimizer_step` copies them back. Gradients are
all-reduced in fp32 by a DDP communication hook (gloo sums bf16 in bf16, which loses low bits: 256 + 1
stays 256), then unscaled into the masters' fp32 `.grad`. Between boundaries, micro-step gradients accumulate in
the 16-bit `.grad` (DDP's buckets), where DeepSpeed accumulates in fp32: one extra rounding per
accumulation step, within the bf16 tolerance the tests document.

The state dict is assembled here, not by `get_state_dict`: that helper finds optimizer state through the
module's own parameters and cannot see fp32 masters, and one path for fp32 and 16-bit is simpler.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from deepfleet.engine import comm
from deepfleet.engine.autotp import tp_shard
from deepfleet.engine.moe.groups import by_expert_groups, expert_groups
from deepfleet.engine.zero.gradients import (
    clip_to_norm_,
    split_global_norm,
    tensor_parallel_norm,
)
from deepfleet.engine.zero.optim_state import (
    ensure_optimizer_state,
    fqn_optimizer_state,
    load_fqn_optimizer_state,
)

_MB = 1024 * 1024


class _HookState:
    """What the comm hooks read at every bucket: the group, its size, and whether this step's gradients
    are reduced at all. An optimizer that reduces them itself once its warm-up is over (the 1-bit
    optimizers of `engine/onebit/`) answers through `reduce` (called before the step's backward)."""

    def __init__(self, group: Any, world_size: int) -> None:
        self.group = group
        self.world_size = world_size
        self.reduce: Any = None  # None, or a callable -> bool

    def local(self) -> bool:
        return self.reduce is not None and not self.reduce()


def _local_future(buffer: torch.Tensor) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


def _allreduce_hook(state, bucket):  # noqa: ANN001 - DDP checks real (not string) annotations
    """Average a gradient bucket (`dist.GradBucket`) through `engine.comm`, so DDP's bucket reductions
    are counted like every other collective; `state` is a `_HookState`. Returns the future DDP waits on
    (torch's default hook does the same, uncounted)."""
    if state.local():
        return _local_future(bucket.buffer())
    buffer = bucket.buffer().div_(state.world_size)
    future = comm.all_reduce_gradients(buffer, group=state.group, async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0])


def _fp32_allreduce_hook(state, bucket):  # noqa: ANN001 - DDP checks real (not string) annotations
    """Average a 16-bit gradient bucket (`dist.GradBucket`) in fp32, then store the result back in the
    bucket's dtype; `state` is a `_HookState`. Returns the future DDP waits on."""
    buffer = bucket.buffer()
    if state.local():
        return _local_future(buffer)
    wide = buffer.to(torch.float32).div_(state.world_size)
    future = comm.all_reduce_gradients(wide, group=state.group, async_op=True).get_future()
    return future.then(lambda fut: buffer.copy_(fut.value()[0]))


class DDPStrategy:
    """Stage 0 (see module docstring)."""

    _tp: list[int] = []  # indices of tensor-parallel shares (none for subclasses that skip __init__)
    _tp_group: Any = None
    _norm: float | None = None  # the global gradient norm finish_gradients took (clip_grad_norm_ uses it)

    def __init__(
        self,
        model: nn.Module,
        *,
        compute_dtype: torch.dtype,
        zero_config: Any,
        process_group: Any = None,
    ) -> None:
        self._model = model
        self._group = process_group
        self._world_size = comm.get_world_size(process_group)
        self._names = [name for name, p in model.named_parameters() if p.requires_grad]
        params = [p for p in model.parameters() if p.requires_grad]
        # fp32 masters are taken before the cast, so they hold the exact initial weights.
        if compute_dtype == torch.float32:
            self._masters = params
        else:
            self._masters = [p.detach().clone().float() for p in params]
            model.to(compute_dtype)
        self._params = params
        # Expert parameters on an expert-parallel mesh stay out of DDP (which would average them over
        # every data-parallel rank) and are averaged over their expert-data-parallel group here.
        self._experts = [i for i, p in enumerate(params) if expert_groups(p) is not None]
        # per expert-parallel degree (moe/groups.py): its groups and its parameters' indices
        self._ep = by_expert_groups((params[i], i) for i in self._experts)
        if self._experts:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                model, [self._names[i] for i in self._experts])
        self._master_of = {id(p): m for p, m in zip(params, self._masters, strict=True)}
        # tensor-parallel shares (engine/autotp.py): their squares also sum over the tp group, and a step is
        # skipped on every rank (not only this data-parallel group) when any rank overflows
        self._tp = [i for i, p in enumerate(params) if tp_shard(p) is not None]
        self._tp_group = tp_shard(params[self._tp[0]]).group if self._tp else None
        # reduce_bucket_size counts elements (DeepSpeed's unit); DDP wants MiB of fp32 gradients.
        bucket_elements = getattr(zero_config, "reduce_bucket_size", None) or 25 * _MB // 4
        self.module = DistributedDataParallel(
            model,
            process_group=process_group,
            gradient_as_bucket_view=True,
            # buffers are synced once at construction; per-forward syncs would put a collective on
            # every micro-step.
            forward_sync_buffers=False,
            bucket_cap_mb=bucket_elements * 4 / _MB,
        )
        hook = _allreduce_hook if compute_dtype == torch.float32 else _fp32_allreduce_hook
        self._hook_state = _HookState(process_group, self._world_size)
        self.module.register_comm_hook(self._hook_state, hook)
        self._optimizer: torch.optim.Optimizer | None = None

    def optimizer_param_groups(self, groups: list[dict]) -> list[dict]:
        out = []
        for i, group in enumerate(groups):
            tensors = []
            for p in group["params"]:
                if id(p) not in self._master_of:
                    raise ValueError(
                        f"model_parameters[{i}]: a tensor that is not a trainable parameter of the model; "
                        "pass model.parameters() or groups over them"
                    )
                tensors.append(self._master_of[id(p)])
            out.append({**{k: v for k, v in group.items() if k != "process_group"}, "params": tensors})
        return out

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        reduce = getattr(optimizer, "reduce_gradients", None)
        if callable(reduce):  # a 1-bit optimizer: it averages (compressed) once its warm-up is over
            optimizer.bind_process_group(self._group)
            self._hook_state.reduce = reduce

    def set_gradient_sync(self, enabled: bool) -> None:
        # DDP reads this flag when forward starts (it is what `no_sync()` toggles).
        self.module.require_backward_grad_sync = enabled

    def finish_gradients(self, *, grad_scale: float) -> bool:
        # DDP has already averaged the gradients during backward; copy/unscale into the masters.
        self._reduce_experts()
        grads = []
        for p, m in zip(self._params, self._masters, strict=True):
            if p.grad is None:
                continue
            if m is not p:
                if m.grad is None:
                    m.grad = torch.empty_like(m)
                m.grad.copy_(p.grad)
            grads.append(m.grad)
        if grads and grad_scale != 1.0:
            torch._foreach_div_(grads, grad_scale)
        # The global norm is needed anyway (clip_grad_norm_ reports it) and is nonfinite exactly when
        # some gradient holds inf/nan (zero/gradients.py), so it is taken here and read for overflow: no
        # separate pass over every gradient. Gradients are identical after the all-reduce, but one
        # element is agreed explicitly so a rank whose gradients were altered after the reduction
        # cannot step alone.
        self._norm = self._global_norm()
        flag = torch.tensor([0.0 if math.isfinite(self._norm) else 1.0])
        comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=None if self._tp else self._group)  # None: every rank
        return bool(flag.item() > 0)

    def _reduce_experts(self) -> None:
        """Average expert gradients over their expert-data-parallel group (in fp32), in the 16-bit
        `.grad` that finish_gradients copies into the masters."""
        for groups, indices in self._ep:
            for i in indices:
                p = self._params[i]
                if p.grad is None:  # no token reached this expert: it still takes part in the reduction
                    p.grad = torch.zeros_like(p)
                if groups.dp_size > 1:
                    wide = p.grad.to(torch.float32)
                    comm.all_reduce(wide, group=groups.dp_group)
                    p.grad.copy_(wide.div_(groups.dp_size))

    def _global_norm(self) -> float:
        # Dense gradients are whole on every rank; expert gradients are whole per ep rank, different
        # across the ep group (zero/gradients.py sums them there). On the steps a 1-bit optimizer keeps
        # gradients local, it is this rank's local norm.
        experts = set(self._experts)
        dense = [m.grad for i, m in enumerate(self._masters) if m.grad is not None and i not in experts]
        expert = [(groups.ep_group, [self._masters[i].grad for i in indices if self._masters[i].grad is not None])
                  for groups, indices in self._ep]
        norm = float(split_global_norm(dense, expert).item())
        return tensor_parallel_norm(norm, [self._masters[i].grad for i in self._tp if self._masters[i].grad is not None],
                                    self._tp_group)

    def clip_grad_norm_(self, max_norm: float) -> float:
        norm = self._norm if self._norm is not None else self._global_norm()  # finish_gradients took it
        self._norm = None
        clip_to_norm_([m.grad for m in self._masters if m.grad is not None], max_norm, norm=norm)
        return norm

    def after_optimizer_step(self) -> None:
        if self._masters is self._params:
            return
        with torch.no_grad():
            for p, m in zip(self._params, self._masters, strict=True):
                p.copy_(m)

    def zero_grad(self) -> None:
        self._norm = None
        # In place, so gradients stay views into DDP's buckets.
        for p in self._params:
            if p.grad is not None:
                p.grad.zero_()
        if self._masters is not self._params:
            for m in self._masters:
                m.grad = None

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        optimizer_state = []
        if self._optimizer is not None:
            for state in self._optimizer.state.values():
                optimizer_state.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        masters = [] if self._masters is self._params else list(self._masters)
        grads = [p.grad for p in self._params if p.grad is not None]
        grads += [m.grad for m in masters if m.grad is not None]
        return {"params": list(self._params), "grads": grads, "optimizer": optimizer_state, "master": masters}

    def state_dict(self) -> dict:
        names = dict(zip(map(id, self._masters), self._names, strict=True))
        # the rest of the model's state (persistent buffers, frozen parameters) as the other stages save it
        model = {name: value.detach() for name, value in self._model.state_dict().items()}
        model.update(zip(self._names, self._masters, strict=True))
        optim = {}
        if self._optimizer is not None:
            ensure_optimizer_state(self._optimizer)  # a fresh engine's state dict is a load target
            optim = fqn_optimizer_state(self._optimizer, names)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict) -> None:
        model = state["model"]
        trainable = set(self._names)
        own = self._model.state_dict()
        with torch.no_grad():
            for name, m in zip(self._names, self._masters, strict=True):
                m.copy_(model[name])
            for name, value in model.items():  # buffers and frozen parameters
                if name not in trainable:
                    if name not in own:
                        raise ValueError(f"checkpoint model.{name}: not a parameter or buffer of the model")
                    own[name].copy_(value)
        self.after_optimizer_step()
        if state.get("optim") and self._optimizer is not None:
            tensors = dict(zip(self._names, self._masters, strict=True))
            load_fqn_optimizer_state(self._optimizer, state["optim"], tensors)
