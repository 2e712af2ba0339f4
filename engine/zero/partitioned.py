"""ZeRO stages 1 and 2: parameters replicated on every rank; optimizer state (stage 1) and also
gradients (stage 2) partitioned across each parameter's data-parallel group. Built by `engine/build.py`
through the `StrategyFactory` signature and driven by `engine/engine.py` through the `ZeroStrategy` methods.
This module holds what both share (`_Partitioned`) and stage 2; stage 1 is `zero/stage1.py`.

Why our own: PyTorch has no replicated-parameter / partitioned-gradient strategy. FSDP2 with
`reshard_after_forward=False` still keeps parameters sharded between steps (ZeRO-3 memory, not ZeRO-2),
and `ZeroRedundancyOptimizer` partitions whole parameters, keeps full gradients and has no stage 2.
So these strategies are written on `torch.distributed` collectives, with the per-parameter dim-0
layout of `zero/layout.py` (the same layout FSDP2 and `DTensor` `Shard(0)` use, so checkpoints reshard
between world sizes and between stages 1, 2 and 3).

Param groups carry their process group. `optimizer_param_groups` lays the partition out per group: a
group dict may name `"process_group"` (default: the strategy's `process_group`, the data-parallel
group), and that group's parameters are sharded, reduced and gathered over it, in buckets of their
own (a bucket never mixes groups). An expert-parallel group is just another group. The layout (and,
in 16-bit training, the fp32 masters and the cast of the model) is fixed by that call, which
`build.py` makes right after construction; a forward before it lays everything out over the default
group.

The optimizer's tensors are `DTensor`s of each parameter's global shape, `Shard(0)` over the param
group's mesh, whose local tensor is this rank's rows (a view of the parameter in fp32, an fp32 master
shard in 16-bit mode); their gradients are `DTensor`s too. So whole-tensor math in the optimizer
(LAMB's trust ratio ||w|| / ||u||, clipping) sees the whole parameter at every stage, and torch's
foreach optimizers run unchanged on the local rows. DTensor's `Shard(0)` splits like `torch.chunk`
(chunks of ceil(d / N) rows, trailing ranks possibly empty), which is exactly `layout.py`'s split.
A 0-dim parameter is laid out as one row: its optimizer tensor has global shape (1,), owned by group
rank 0.

On gloo a group's parameters are views of one param-major flat buffer (`zero/flat.py`): publishing the
updated rows is an in-place all-reduce of the parameters themselves (other ranks' rows zeroed), and stage
1 reduces its full gradients the same way, in place, with `p.grad` a view of the reduced chunk — no
rank-major packing, landing copy or unpacking. Other backends use `zero/layout.py`'s rank-major
buckets with the real reduce-scatter and all-gather.

Memory per rank, P parameters, N ranks, fp32 AdamW (no master copy: the optimizer's tensors are views):
stage 1 holds 4P params + 4P full grads + 8P/N Adam state (16-bit: + 4P/N masters + 4P/N fp32 gradient
shards); stage 2 holds 4P params + 4P/N gradient shards + 8P/N Adam state. Beside that, only flat
buffers of at most `reduce_bucket_size` elements exist while a bucket is reduced (one at a time, two
with `overlap_comm`), each released as its reduction lands.

Step protocol, per optimizer step:
  stage 1: micro-steps accumulate full `p.grad` with no communication; the boundary reduces bucket by
           bucket (chunk by chunk on gloo) into this rank's rows: in `finish_gradients`, or with
           `overlap_comm` on gloo from hooks during the boundary backward (`zero/stage1.py`).
  stage 2: on every micro-step (DeepSpeed's semantics: stage 2 is the memory stage) a
           post-accumulate-grad hook packs each final gradient into its bucket's flat buffer and frees
           `p.grad`; a full bucket launches a reduce-scatter (async with `overlap_comm`) that adds into
           the persistent gradient shards; the end of backward flushes buckets whose parameters got no
           gradient and waits. Buckets of one process group launch strictly in order, so every rank
           issues the same collective sequence. With `zero_optimization.deepfleet_local_grad_accumulation`
           (deepfleet's own key, not DeepSpeed's) non-boundary micro-steps instead accumulate full
           `p.grad` locally and only the boundary micro-step communicates: 1/gas of the communication,
           at the cost of full gradients (4P) living through the accumulation window.
  both:    average over each group's ranks and unscale (one division: no PREMUL_SUM on gloo), take the
           global norm, whose all-reduce is also the inf/nan agreement, clip with it
           (`zero/gradients.py`), step, then `after_optimizer_step` all-gathers the
           updated rows. A parameter that got no gradient is reduced as zeros (as DDP and DeepSpeed do),
           so weight decay still applies to it.

State dicts: model entries are full replicated tensors keyed by FQN (in 16-bit mode the trainable ones
are the fp32 masters as Shard(0) DTensors); optimizer state is keyed by FQN, per-element entries as
Shard(0) DTensors of the parameter's shape, `step` plain. A 0-dim parameter's state is plain (its
owner, group rank 0, broadcasts it).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.weak import WeakIdKeyDictionary

from deepfleet.engine import comm
from deepfleet.engine.autotp import tp_shard
from deepfleet.engine.moe.groups import by_expert_groups, expert_groups
from deepfleet.engine.zero import gradients
from deepfleet.engine.zero.flat import GradChunk, ParamRun, flatten, gather_in_place
from deepfleet.engine.zero.gradients import clip_to_norm_, global_norm, split_global_norm
from deepfleet.engine.zero.layout import (
    Bucket,
    Landing,
    Slot,
    all_gather_params,
    build_buckets,
    local_rows,
    make_slot,
    on_gloo,
    reduce_scatter,
)

_MASTER_DTYPE = torch.float32  # dtype of what the optimizer updates and of gradient reductions

# parameter -> its stage-2 gradient hook; model -> its pending-layout forward pre-hook. Weak, by identity
# (a tensor's == is elementwise): a model handed to a second strategy feeds only that one.
_GRAD_HOOKS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_LAYOUT_HOOKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _Partitioned(ABC):
    """What stages 1 and 2 share: layout, masters, averaging, clipping, publishing and state dicts."""

    holds_grad_shards: bool  # stage 2: gradients live only as persistent shards between steps

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        compute_dtype: torch.dtype,
        zero_config: Any,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.module = model
        self.group = process_group
        self.world_size = comm.get_world_size(process_group)
        self.rank = comm.get_rank(process_group)
        self.overlap_comm = bool(zero_config.overlap_comm)
        self.compute_dtype = compute_dtype
        self.mixed = compute_dtype != _MASTER_DTYPE
        self._reduce_numel = int(zero_config.reduce_bucket_size)
        self._gather_numel = int(zero_config.allgather_bucket_size)
        self.optimizer: torch.optim.Optimizer | None = None
        self._meshes: dict[int, DeviceMesh] = {}
        # Called with a point name while transient buffers are at their largest (engine/memory.py's
        # HighWater sets it), so peak measurements see flat buffers that never outlive a call.
        self.memory_probe: Callable[[str], None] | None = None

        self._sync = True  # False on non-boundary micro-steps
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in trainable]
        self._params = [p for _, p in trainable]
        for name, p in zip(self._names, self._params, strict=True):
            if not p.is_contiguous():
                raise ValueError(
                    f"parameter {name} is not contiguous; call .contiguous() on it before initialize"
                )
            if p.dtype != _MASTER_DTYPE:
                raise ValueError(
                    f"parameter {name} is {p.dtype}; pass the model in float32 and enable bf16/fp16 "
                    "in the config (the fp32 masters are taken from it)"
                )
        self._index = {id(p): i for i, p in enumerate(self._params)}
        with torch.no_grad():  # buffers are replicated over the data-parallel group, as DDP does
            for t in model.buffers():
                comm.broadcast(t.detach(), group=self.group, group_src=0)
        self._groups_of: list[dist.ProcessGroup | None] | None = None  # per parameter, once laid out
        self._inflight: list[Landing] = []  # reductions not yet landed (their flats are alive)
        self._staged: list[torch.Tensor] = []  # flat buffers being packed (stage 1)
        self._grad_chunks: list[GradChunk] = []  # stage 1 on gloo: in-place reductions in flight
        self._param_runs: list[ParamRun] = []  # gloo groups' parameters as views of flat buffers
        self._norm: float | None = None  # the global gradient norm taken by finish_gradients
        previous = _LAYOUT_HOOKS.get(model)
        if previous is not None:
            previous.remove()
        _LAYOUT_HOOKS[model] = model.register_forward_pre_hook(lambda *_: self._ensure_layout())

    # --- layout ---------------------------------------------------------------------------------------

    def _ensure_layout(self) -> None:
        if self._groups_of is None:
            self._lay_out([self.group] * len(self._params))

    def _lay_out(self, groups_of: list[dist.ProcessGroup | None]) -> None:
        """Shard every trainable parameter over its process group: rows, masters, optimizer DTensors and
        buckets (built per group, in first-appearance order, the same on every rank)."""
        if self._groups_of is not None:
            if all(a is b for a, b in zip(self._groups_of, groups_of, strict=True)):
                return
            if self.mixed:
                raise ValueError(
                    "optimizer param groups: the process groups changed after the 16-bit masters were "
                    "taken; call optimizer_param_groups once, with the final groups"
                )
        hook = _LAYOUT_HOOKS.get(self.module)
        if hook is not None:
            hook.remove()
            del _LAYOUT_HOOKS[self.module]
        with torch.no_grad():  # every replica starts from its group rank 0's weights, as DDP does
            for p, pg in zip(self._params, groups_of, strict=True):
                comm.broadcast(p.detach(), group=pg, group_src=0)
        self._groups_of = list(groups_of)
        self._slots: list[Slot] = [
            make_slot(n, p.shape, offset=0, world_size=comm.get_world_size(pg), rank=comm.get_rank(pg))
            for n, p, pg in zip(self._names, self._params, groups_of, strict=True)
        ]
        order: list[dist.ProcessGroup | None] = []  # process groups in first-appearance order
        for pg in groups_of:
            if not any(pg is g for g in order):
                order.append(pg)
        self._order = order
        masters: list[torch.Tensor] = []
        if self.mixed:
            # Masters come from the fp32 model before the cast, so they are exact.
            masters = [local_rows(p.detach(), s).to(_MASTER_DTYPE, copy=True) for p, s in zip(self._params, self._slots, strict=True)]
            self.module.to(self.compute_dtype)  # keeps Parameter identity (p.data is swapped)
        # On gloo each group's parameters become views of one flat buffer (zero/flat.py), before the
        # optimizer's fp32 views of them are taken.
        self._param_runs = flatten(
            self._params,
            [(pg, [i for i, g in enumerate(groups_of) if g is pg]) for pg in order if on_gloo(pg)],
        )
        locals_ = masters or [local_rows(p.detach(), s) for p, s in zip(self._params, self._slots, strict=True)]
        self._opt_locals = locals_
        self._opt_tensors = [self._dtensor(t, i) for i, t in enumerate(locals_)]

        self._reduce_buckets: list[Bucket] = []
        self._gather_buckets: list[Bucket] = []  # groups not on gloo (gloo gathers in place)
        self._queues: list[list[int]] = []  # per process group: its reduce buckets, in launch order
        for pg in order:
            named = [(n, p) for n, p, g in zip(self._names, self._params, groups_of, strict=True) if g is pg]
            size, rank = comm.get_world_size(pg), comm.get_rank(pg)
            reduce = build_buckets(named, bucket_numel=self._reduce_numel, world_size=size, rank=rank, group=pg)
            start = len(self._reduce_buckets)
            self._queues.append(list(range(start, start + len(reduce))))
            self._reduce_buckets += reduce
            if not on_gloo(pg):
                self._gather_buckets += build_buckets(
                    named, bucket_numel=self._gather_numel, world_size=size, rank=rank, group=pg
                )
        self._queue_of = {b: q for q, bs in enumerate(self._queues) for b in bs}
        self._where: dict[int, tuple[int, int]] = {}  # param index -> (reduce bucket, slot)
        for b, bucket in enumerate(self._reduce_buckets):
            for s, p in enumerate(bucket.params):
                self._where[self._index[id(p)]] = (b, s)
        # Persistent fp32 gradient shards, one segment per reduce bucket (padding stays zero).
        self._grad_segments: list[torch.Tensor] = []
        if self.holds_grad_shards or self.mixed:
            self._grad_segments = [
                torch.zeros(b.segment_numel, dtype=_MASTER_DTYPE, device=b.params[0].device)
                for b in self._reduce_buckets
            ]
        # Their optimizer-facing DTensors, built once: the shards persist, so each step only re-attaches
        # them (a DTensor per parameter per step cost ~20 ms on the MoE benchmark's model).
        self._grad_dtensors = [self._dtensor(self._local_grad(i), i) for i in range(len(self._params))
                               ] if self._grad_segments else None
        self._segment_dtensors = [  # each whole segment as a Shard(0) piece over its bucket's group (norms)
            DTensor.from_local(segment, self._mesh(bucket.group), [Shard(0)], run_check=False)
            for segment, bucket in zip(self._grad_segments, self._reduce_buckets, strict=True)
        ] if self._grad_segments else []
        self._on_layout()

    @abstractmethod
    def _on_layout(self) -> None:
        """Set up the subclass's state that depends on the buckets (called at the end of `_lay_out`)."""

    def _hook_gradients(self, hook: Callable[[torch.Tensor], None] | None) -> None:
        """Make `hook` every trainable parameter's post-accumulate-grad hook (None: no hook). A model handed
        to a second strategy (initialize called again) must not keep feeding the first one: its hook
        would reduce the gradient or free p.grad before ours runs."""
        for p in self._params:
            previous = _GRAD_HOOKS.pop(p, None)
            if previous is not None:
                previous.remove()
            if hook is not None:
                _GRAD_HOOKS[p] = p.register_post_accumulate_grad_hook(hook)

    def _mesh(self, pg: dist.ProcessGroup | None) -> DeviceMesh:
        key = id(pg)
        if key not in self._meshes:
            self._meshes[key] = DeviceMesh.from_group(pg if pg is not None else dist.group.WORLD, self._device().type)
        return self._meshes[key]

    def _dtensor(self, local: torch.Tensor, i: int) -> DTensor:
        """`local` (this rank's rows of parameter i) as a Shard(0) DTensor of the parameter's global shape
        ((1,) for a 0-dim parameter); no copy."""
        slot = self._slots[i]
        shape = slot.shape if len(slot.shape) else torch.Size([1])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            local, self._mesh(self._groups_of[i]), [Shard(0)], run_check=False, shape=shape, stride=stride
        )

    # --- ZeroStrategy ---------------------------------------------------------------------------------

    def optimizer_param_groups(self, groups: list[dict]) -> list[dict]:
        """Same groups over this rank's optimizer DTensors (views of local rows, or fp32 master shards),
        laying the partition out per group's `"process_group"` (removed from the returned groups).
        Frozen parameters are dropped (they never get gradients). Raises ValueError for a tensor that is
        not a parameter of the model, or one parameter placed in groups with different process groups."""
        frozen = {id(p) for p in self.module.parameters() if not p.requires_grad}
        groups_of: list[dist.ProcessGroup | None] = [self.group] * len(self._params)
        placed: set[int] = set()
        for g, group in enumerate(groups):
            pg = group.get("process_group", self.group)
            for t in group["params"]:
                i = self._index.get(id(t))
                if i is None:
                    if id(t) not in frozen:
                        raise ValueError(
                            f"optimizer param_groups[{g}].params: a tensor of shape {tuple(t.shape)} is not "
                            "a parameter of the model; pass model.parameters() or groups over them"
                        )
                    continue
                if i in placed and groups_of[i] is not pg:
                    raise ValueError(
                        f"optimizer param_groups[{g}].params: {self._names[i]} is also in an earlier group "
                        "with another process_group; put each parameter in one group"
                    )
                groups_of[i] = pg
                placed.add(i)
        self._lay_out(groups_of)
        out = []
        for group in groups:
            mapped = [self._opt_tensors[self._index[id(t)]] for t in group["params"] if id(t) in self._index]
            out.append({**{k: v for k, v in group.items() if k != "process_group"}, "params": mapped})
        return out

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def set_gradient_sync(self, enabled: bool) -> None:
        self._sync = enabled

    def finish_gradients(self, *, grad_scale: float) -> bool:
        self._ensure_layout()
        self._reduce()
        self._attach_grads()
        # One division per group size: the sum over that group's ranks becomes the mean, unscaled.
        by_divisor: dict[float, list[torch.Tensor]] = {}
        for b, bucket in enumerate(self._reduce_buckets):
            if self._grad_segments:
                targets = [self._grad_segments[b]]
            else:
                targets = [self._local_grad(i) for i in self._bucket_params(b)]
            by_divisor.setdefault(float(bucket.world_size) * float(grad_scale), []).extend(targets)
        for divisor, tensors in by_divisor.items():
            torch._foreach_div_(tensors, divisor)
        # The global norm is needed anyway (clip_grad_norm_ reports it); it is nonfinite on every rank
        # exactly when some rank's gradients hold inf/nan, so its one all-reduce is also the overflow
        # agreement (zero/gradients.py).
        self._norm = self._global_grad_norm()
        return not math.isfinite(self._norm)

    def _global_grad_norm(self) -> float:
        # Expert parameters (moe/groups.py) reduce over their expert-data-parallel group; each ep rank
        # holds other experts, so their squares are also summed over the ep group (split_global_norm),
        # one pair of groups per expert-parallel degree.
        ep = by_expert_groups((p, None) for p in self._params)
        degree_of = {id(g.dp_group): k for k, (g, _) in enumerate(ep)}  # expert-data-parallel group -> degree
        dense: list[torch.Tensor] = []
        experts: list[list[torch.Tensor]] = [[] for _ in ep]
        if self._grad_segments:
            # one norm per bucket segment (padding is zero), each a Shard(0) piece over its bucket's group
            for piece, bucket in zip(self._segment_dtensors, self._reduce_buckets, strict=True):
                k = degree_of.get(id(bucket.group))
                (dense if k is None else experts[k]).append(piece)
        else:
            for p, t in zip(self._params, self._opt_tensors, strict=True):
                if t.grad is not None:
                    k = degree_of.get(id(g.dp_group)) if (g := expert_groups(p)) is not None else None
                    (dense if k is None else experts[k]).append(t.grad)
        norm = float(split_global_norm(dense, [(g.ep_group, ts) for (g, _), ts in zip(ep, experts, strict=True)]).item())
        split = [i for i, p in enumerate(self._params) if tp_shard(p) is not None]  # engine/autotp.py
        if split:  # tp ranks hold other rows of these: their squares sum over the tp group too
            shards = ([self._dtensor(self._local_grad(i), i) for i in split] if self._grad_segments
                      else [self._opt_tensors[i].grad for i in split if self._opt_tensors[i].grad is not None])
            norm = gradients.tensor_parallel_norm(norm, shards, tp_shard(self._params[split[0]]).group)
        return norm

    def clip_grad_norm_(self, max_norm: float) -> float:
        grads = [t.grad for t in self._opt_tensors if t.grad is not None]
        norm = self._norm if self._norm is not None else float(global_norm(grads).item())
        self._norm = None
        clip_to_norm_(grads, max_norm, norm=norm)
        return norm

    def after_optimizer_step(self) -> None:
        with torch.no_grad():
            if self.mixed:
                for p, slot, master in zip(self._params, self._slots, self._opt_locals, strict=True):
                    local_rows(p.detach(), slot).copy_(master)
            for run in self._param_runs:
                gather_in_place(run, self._params, self._slots, bound=self._gather_numel)
            for bucket in self._gather_buckets:
                all_gather_params(bucket)

    def zero_grad(self) -> None:
        self._norm = None
        for p in self._params:
            p.grad = None
        if self._groups_of is not None:
            for t in self._opt_tensors:
                t.grad = None

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        self._ensure_layout()
        grads = [p.grad for p in self._params if p.grad is not None]
        grads += [_local(t.grad) for t in self._opt_tensors if t.grad is not None]
        grads += self._grad_segments
        grads += self._transient_buffers()
        optim: list[torch.Tensor] = []
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                optim += [v for v in state.values() if isinstance(v, torch.Tensor)]  # DTensors as they are
        return {
            "params": list(self.module.parameters()),
            "grads": grads,
            "optimizer": optim,
            "master": list(self._opt_locals) if self.mixed else [],
        }

    # --- gradients ------------------------------------------------------------------------------------

    @abstractmethod
    def _reduce(self) -> None:
        """Leave the SUM over ranks of this rank's gradient rows where `_attach_grads` points."""

    def _transient_buffers(self) -> list[torch.Tensor]:
        """Flat buffers alive right now (packed or in flight): reported as gradient memory."""
        return (
            self._staged
            + [landing.flat for landing in self._inflight if landing.flat is not None]
            + [chunk.flat for chunk in self._grad_chunks]
        )

    def _probe(self, point: str) -> None:
        if self.memory_probe is not None:
            self.memory_probe(point)

    def _track(self, landing: Landing) -> None:
        """Keep at most one reduction in flight besides the newest (double buffering with
        `overlap_comm`); a landed reduction is dropped, releasing its flat buffer."""
        if not landing.done:
            self._inflight.append(landing)
        while len(self._inflight) > 1:
            self._inflight.pop(0).wait()

    def _drain(self) -> None:
        while self._inflight:
            self._inflight.pop(0).wait()

    def _bucket_params(self, b: int) -> list[int]:
        return [self._index[id(p)] for p in self._reduce_buckets[b].params]

    def _local_grad(self, i: int) -> torch.Tensor:
        """This rank's reduced rows of parameter i (a view)."""
        b, s = self._where[i]
        if self._grad_segments:
            return self._reduce_buckets[b].segment_view(self._grad_segments[b], s)
        # stage 1, fp32: the reduced rows were written into p.grad itself
        return local_rows(self._params[i].grad, self._slots[i])

    def _attach_grads(self) -> None:
        """Point each optimizer DTensor's .grad at this rank's reduced rows (as a DTensor)."""
        if self._grad_dtensors is not None:
            for t, grad in zip(self._opt_tensors, self._grad_dtensors, strict=True):
                t.grad = grad
            return
        for i, t in enumerate(self._opt_tensors):
            t.grad = self._dtensor(self._local_grad(i), i)

    def _device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

    # --- state dicts ----------------------------------------------------------------------------------

    def _sharded(self, value: torch.Tensor, i: int) -> torch.Tensor:
        """A per-element value of parameter i (its optimizer DTensor's shape, or its local rows) as a
        state-dict entry: a Shard(0) DTensor of the parameter's shape; for a 0-dim parameter, the value
        broadcast from its owner (group rank 0) as a plain 0-dim tensor."""
        slot = self._slots[i]
        local = _local(value).detach()
        if len(slot.shape) == 0:
            scalar = local.reshape(()).clone() if slot.local_rows else local.new_empty(())
            comm.broadcast(scalar, group=self._groups_of[i], group_src=0)
            return scalar
        return value.detach() if isinstance(value, DTensor) else self._dtensor(local, i)

    def state_dict(self) -> dict:
        """Model: full replicated tensors keyed by FQN; in 16-bit mode the trainable parameters are the
        fp32 masters as Shard(0) DTensors (the full-precision values, as FSDP2 mixed precision saves).
        Optimizer: per-element state as Shard(0) DTensors, `step` as a plain tensor, keyed by FQN."""
        self._ensure_layout()
        index = {n: i for i, n in enumerate(self._names)}
        model: dict[str, torch.Tensor] = {}
        for name, value in self.module.state_dict().items():
            i = index.get(name)
            if i is not None and self.mixed:
                model[name] = self._sharded(self._opt_tensors[i], i)
            else:
                model[name] = value.detach()
        return {"model": model, "optim": self._optim_state_dict()}

    def _optimizer_fqns(self) -> list[str]:
        """The FQN of every optimizer tensor, in the optimizer's own order."""
        assert self.optimizer is not None, "bind_optimizer() first"
        by_id = {id(t): self._names[i] for i, t in enumerate(self._opt_tensors)}
        return [by_id[id(t)] for g in self.optimizer.param_groups for t in g["params"]]

    def _optim_state_dict(self) -> dict:
        if self.optimizer is None:
            return {"state": {}, "param_groups": []}
        self._ensure_optimizer_state()
        index = {n: i for i, n in enumerate(self._names)}
        state: dict[str, dict[str, Any]] = {}
        for fqn in self._optimizer_fqns():
            i = index[fqn]
            t = self._opt_tensors[i]
            entries = self.optimizer.state.get(t, {})
            state[fqn] = {k: self._sharded(v, i) if _per_element(k, v, t) else v for k, v in sorted(entries.items())}
        groups = []
        fqns = iter(self._optimizer_fqns())
        for g in self.optimizer.param_groups:
            groups.append(
                {**{k: v for k, v in g.items() if k != "params"}, "params": [next(fqns) for _ in g["params"]]}
            )
        return {"state": state, "param_groups": groups}

    def _ensure_optimizer_state(self) -> None:
        """Give a fresh optimizer its state tensors (one step with zero gradients and lr 0, then the
        step counts reset to 0: the same as never having stepped), so a state dict taken before the
        first step has every entry `dcp.load` must fill in place."""
        assert self.optimizer is not None
        if self.optimizer.state:
            return
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for t in self._opt_tensors:
            t.grad = torch.zeros_like(t)
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
        for t in self._opt_tensors:
            t.grad = None
            if t not in self.optimizer.state:
                continue
            step = self.optimizer.state[t].get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                self.optimizer.state[t]["step"] = 0

    def load_state_dict(self, state: dict) -> None:
        """Load `state_dict()`-shaped state; model entries may be full tensors or Shard(0) DTensors of
        any world size's save (dcp.load reshards them in place before this is called)."""
        self._ensure_layout()
        index = {n: i for i, n in enumerate(self._names)}
        own = self.module.state_dict()
        with torch.no_grad():
            for name, value in state.get("model", {}).items():
                if name not in own:
                    raise ValueError(f"checkpoint model.{name}: not a parameter or buffer of the model")
                i = index.get(name)
                if i is None:
                    own[name].copy_(_full(value))
                    continue
                rows = self._local_from(value, self._slots[i])
                if self.mixed:
                    self._opt_locals[i].copy_(rows)
                else:
                    local_rows(self._params[i].detach(), self._slots[i]).copy_(rows)
        if "optim" in state and state["optim"].get("param_groups"):
            self._load_optim(state["optim"])
        self.after_optimizer_step()  # publish the loaded rows to every replica

    def _local_from(self, value: torch.Tensor, slot: Slot) -> torch.Tensor:
        """This rank's rows of a saved per-element value (DTensor shard, or full tensor)."""
        if isinstance(value, DTensor):
            return value.to_local().reshape(slot.local_shape)
        if len(slot.shape) == 0:
            return value.reshape(1)[: slot.local_rows]
        return local_rows(value.contiguous(), slot)

    def _load_optim(self, optim: dict) -> None:
        assert self.optimizer is not None, "bind_optimizer() first"
        index = {n: i for i, n in enumerate(self._names)}
        position = {fqn: k for k, fqn in enumerate(self._optimizer_fqns())}
        new_state: dict[int, dict[str, Any]] = {}
        for fqn, entries in optim["state"].items():
            if fqn not in position:
                raise ValueError(f"checkpoint optim.state.{fqn}: not a parameter this optimizer updates")
            i = index[fqn]
            slot = self._slots[i]
            new_state[position[fqn]] = {
                k: self._dtensor(self._local_from(v, slot).clone(), i) if _saved_per_element(k, v, slot) else v
                for k, v in entries.items()
            }
        # torch matches saved to current parameters by position, so keep the current order and take
        # each group's hyper-parameters from the checkpoint.
        current = self._optimizer_fqns()
        saved_groups = optim["param_groups"]
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ValueError(
                f"checkpoint optim.param_groups: {len(saved_groups)} groups, the optimizer has "
                f"{len(self.optimizer.param_groups)}; build the optimizer with the same groups"
            )
        groups, start = [], 0
        for g, (saved, live) in enumerate(zip(saved_groups, self.optimizer.param_groups, strict=True)):
            names = current[start : start + len(live["params"])]
            # an expert group's members differ per ep rank and ep_size (moe/utils.py); others must match
            if not saved.get("moe") and sorted(saved["params"]) != sorted(names):
                raise ValueError(
                    f"checkpoint optim.param_groups[{g}].params: the saved group holds different "
                    "parameters than the optimizer's; build the optimizer with the same groups"
                )
            groups.append({**saved, "params": list(range(start, start + len(names)))})
            start += len(names)
        self.optimizer.load_state_dict({"state": new_state, "param_groups": groups})


def _per_element(key: str, value: Any, opt_tensor: torch.Tensor) -> bool:
    """Optimizer state shaped like its tensor (exp_avg, ...) is sharded; `step` and scalars are not."""
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == opt_tensor.shape


def _saved_per_element(key: str, value: Any, slot: Slot) -> bool:
    if isinstance(value, DTensor):
        return True
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == slot.shape


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


class ZeroStage2(_Partitioned):
    """ZeRO stage 2: optimizer state and gradients partitioned; gradients are reduce-scattered bucket by
    bucket during every micro-step's backward (or only the boundary's, with local accumulation) and full
    gradients are freed as soon as packed."""

    holds_grad_shards = True

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        compute_dtype: torch.dtype,
        zero_config: Any,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            model, compute_dtype=compute_dtype, zero_config=zero_config, process_group=process_group
        )
        self.local_accumulation = bool(getattr(zero_config, "deepfleet_local_grad_accumulation", False))
        self._callback_queued = False
        self._hook_gradients(self._on_grad_ready)

    def _on_layout(self) -> None:
        n = len(self._reduce_buckets)
        self._flats: list[torch.Tensor | None] = [None] * n  # being packed, not yet launched
        self._packed: list[set[int]] = [set() for _ in range(n)]
        self._next = [0] * len(self._queues)  # per process group: position of the next bucket to launch
        self._fresh = [True] * n  # the bucket's gradient shard holds nothing of this window yet
        self._reduced_window = False  # any reduction since zero_grad

    def _transient_buffers(self) -> list[torch.Tensor]:
        segments = {id(t) for t in self._grad_segments}  # a one-rank bucket packs into its shard itself
        return [t for t in super()._transient_buffers() + [f for f in self._flats if f is not None]
                if id(t) not in segments]

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync and self.local_accumulation:
            return  # non-boundary micro-step: keep accumulating in p.grad
        self._ensure_layout()
        if not self._callback_queued:
            # the end of this backward flushes buckets that got no gradient and waits for all of them
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True
        b, s = self._where[self._index[id(p)]]
        q = self._queue_of[b]
        assert self._queues[q].index(b) >= self._next[q], "a gradient reached an already-reduced bucket"
        self._pack(b, s, p)
        queue = self._queues[q]
        while self._next[q] < len(queue):
            ready = queue[self._next[q]]
            if len(self._packed[ready]) < len(self._reduce_buckets[ready].params):
                break
            self._launch(ready)

    def _pack(self, b: int, s: int, p: torch.Tensor) -> None:
        bucket = self._reduce_buckets[b]
        flat = self._flats[b]
        if flat is None:
            if bucket.world_size == 1 and self._fresh[b]:
                # one rank (experts at ep = dp): nothing to reduce, so pack straight into the shard
                flat = self._flats[b] = self._grad_segments[b]
            else:
                flat = self._flats[b] = torch.empty(bucket.flat_numel, dtype=_MASTER_DTYPE, device=p.device)
        with torch.no_grad():
            bucket.pack(flat, s, p.grad)
        p.grad = None
        self._packed[b].add(s)

    def _launch(self, b: int) -> None:
        flat = self._flats[b]
        assert flat is not None
        self._probe("reduce")
        landing = reduce_scatter(
            self._reduce_buckets[b],
            flat,
            self._grad_segments[b],
            async_op=self.overlap_comm,
            accumulate=not self._fresh[b],
        )
        del flat
        self._flats[b] = None
        self._fresh[b] = False
        self._packed[b] = set()
        self._next[self._queue_of[b]] += 1
        self._reduced_window = True
        self._track(landing)

    def _flush(self) -> None:
        """Launch, in order, every bucket not launched in this pass (packing zeros, or what p.grad holds,
        for parameters that got no gradient in it), wait for all, and start the next pass."""
        for q, queue in enumerate(self._queues):
            for b in queue[self._next[q] :]:
                for s, p in enumerate(self._reduce_buckets[b].params):
                    if s not in self._packed[b]:
                        self._pack(b, s, p)
                self._launch(b)
        self._drain()
        self._next = [0] * len(self._queues)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self._flush()

    def _reduce(self) -> None:
        # The end of each backward has already reduced everything; a window with no reduction (no
        # backward with sync on) still reduces what p.grad holds, so every rank steps on the same sums.
        if not self._reduced_window:
            self._flush()
        self._drain()

    def zero_grad(self) -> None:
        super().zero_grad()
        if self._groups_of is not None:
            self._fresh = [True] * len(self._reduce_buckets)
            self._reduced_window = False
