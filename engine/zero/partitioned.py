"""ZeRO stages 1 and 2: parameters replicated on every rank; optimizer state (stage 1) and also
gradients (stage 2) partitioned across the data-parallel group. Built by `engine/build.py` through the
`StrategyFactory` signature and driven by `engine/engine.py` through the `ZeroStrategy` methods.

Why our own: PyTorch has no replicated-parameter / partitioned-gradient strategy. FSDP2 with
`reshard_after_forward=False` still keeps parameters sharded between steps (ZeRO-3 memory, not ZeRO-2),
and `ZeroRedundancyOptimizer` partitions whole parameters, keeps full gradients and has no stage 2.
So these strategies are written on `torch.distributed` collectives, with the per-parameter dim-0
layout of `zero/layout.py` (the same layout FSDP2 and `DTensor` `Shard(0)` use, so checkpoints reshard
between world sizes and between stages 1, 2 and 3).

Memory per rank, P parameters, N ranks, fp32 training (the optimizer's tensors are views of this rank's
rows of each parameter, so no master copy): stage 1 holds 4P params + 4P full grads + 8P/N Adam state;
stage 2 holds 4P params + 4P/N gradient shards + 8P/N Adam state between steps (full gradients exist
while micro-steps accumulate, and on the boundary micro-step only until their bucket is packed). In
16-bit training the model is cast to the compute dtype and fp32 master shards (4P/N) are what the
optimizer updates; gradients are reduced in fp32 (gloo would sum bf16 in bf16).

Step protocol, per optimizer step:
  stage 1: micro-steps accumulate full `p.grad` with no communication; `finish_gradients` reduce-scatters
           bucket by bucket into this rank's rows (with `overlap_comm`, packing the next bucket while
           the previous one is in flight).
  stage 2: non-boundary micro-steps accumulate `p.grad` with no communication; on the boundary micro-step
           a post-accumulate-grad hook packs each final gradient into its bucket's flat buffer and frees
           `p.grad`; a full bucket launches an (async with `overlap_comm`) reduce-scatter into the
           persistent gradient shards. Buckets launch strictly in order so every rank issues the same
           collective sequence; `finish_gradients` flushes buckets whose parameters got no gradient.
  both:    average over ranks and unscale (one division: no PREMUL_SUM on gloo), agree on inf/nan,
           clip on the shards, step, then `after_optimizer_step` all-gathers the updated rows.
A parameter that got no gradient is reduced as zeros (as DDP and DeepSpeed do), so weight decay still
applies to it.

State dicts: model entries are full replicated tensors keyed by FQN (in 16-bit mode the trainable ones
are the fp32 masters as Shard(0) DTensors); optimizer state is keyed by FQN, per-element entries as
Shard(0) DTensors of the parameter's shape, `step` plain. A 0-dim parameter's state is plain (its
owner, group rank 0, broadcasts it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.weak import WeakIdKeyDictionary

from deepfleet.engine.zero.layout import (
    Slot,
    all_gather_params,
    build_buckets,
    local_rows,
    make_slot,
    reduce_scatter,
)

_MASTER_DTYPE = torch.float32  # dtype of what the optimizer updates and of gradient reductions

# parameter -> its stage-2 gradient hook; weak, by identity (a tensor's == is elementwise)
_GRAD_HOOKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


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
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.overlap_comm = bool(zero_config.overlap_comm)
        self.mixed = compute_dtype != _MASTER_DTYPE
        self.optimizer: torch.optim.Optimizer | None = None
        self._mesh: DeviceMesh | None = None

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
        self._broadcast_module()

        # Masters come from the fp32 model before the cast, so they are exact.
        slots = _slots(self._names, self._params, world_size=self.world_size, rank=self.rank)
        if self.mixed:
            self._opt_tensors = [
                local_rows(p.detach(), s).to(_MASTER_DTYPE, copy=True)
                for p, s in zip(self._params, slots, strict=True)
            ]
            model.to(compute_dtype)  # keeps Parameter identity (p.data is swapped)
        else:
            self._opt_tensors = [local_rows(p.detach(), s) for p, s in zip(self._params, slots, strict=True)]
        self._slots = slots
        self._index = {id(p): i for i, p in enumerate(self._params)}

        named = list(zip(self._names, self._params, strict=True))
        self._reduce_buckets = build_buckets(
            named,
            bucket_numel=int(zero_config.reduce_bucket_size),
            world_size=self.world_size,
            rank=self.rank,
        )
        self._gather_buckets = build_buckets(
            named,
            bucket_numel=int(zero_config.allgather_bucket_size),
            world_size=self.world_size,
            rank=self.rank,
        )
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

    # --- construction helpers -------------------------------------------------------------------------

    def _broadcast_module(self) -> None:
        """Start every replica from group rank 0's weights and buffers, as DDP does."""
        with torch.no_grad():
            for t in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(t.detach(), group=self.group, group_src=0)

    # --- ZeroStrategy ---------------------------------------------------------------------------------

    def optimizer_param_groups(self, groups: list[dict]) -> list[dict]:
        """Same groups over this rank's optimizer tensors (views of local rows, or fp32 master shards).
        Frozen parameters are dropped (they never get gradients). Raises ValueError for a tensor that is
        not a parameter of the model."""
        frozen = {id(p) for p in self.module.parameters() if not p.requires_grad}
        out = []
        for g, group in enumerate(groups):
            mapped = []
            for t in group["params"]:
                if id(t) in self._index:
                    mapped.append(self._opt_tensors[self._index[id(t)]])
                elif id(t) not in frozen:
                    raise ValueError(
                        f"optimizer param_groups[{g}].params: a tensor of shape {tuple(t.shape)} is not a "
                        "parameter of the model; pass model.parameters() or groups over them"
                    )
            out.append({**group, "params": mapped})
        return out

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def set_gradient_sync(self, enabled: bool) -> None:
        self._sync = enabled

    def finish_gradients(self, *, grad_scale: float) -> bool:
        self._reduce()
        grads = self._attach_grads()
        divisor = float(self.world_size) * float(grad_scale)
        if self._grad_segments:
            torch._foreach_div_(self._grad_segments, divisor)
        else:
            torch._foreach_div_(grads, divisor)
        flags = [(~torch.isfinite(g)).any() for g in (self._grad_segments or grads)]
        bad = torch.stack(flags).any().float().reshape(1) if flags else torch.zeros(1, device=self._device())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        return bool(bad.item() > 0)

    def clip_grad_norm_(self, max_norm: float) -> float:
        grads = [t.grad for t in self._opt_tensors if t.grad is not None and t.numel()]
        sq = torch.zeros((), dtype=_MASTER_DTYPE, device=self._device())
        for g in grads:
            sq += torch.linalg.vector_norm(g, dtype=_MASTER_DTYPE) ** 2
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=self.group)
        norm = sq.sqrt()
        if max_norm > 0 and grads:
            # torch.nn.utils.clip_grad_norm_'s rule: scale by min(1, max_norm / (norm + 1e-6)).
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef)
        return float(norm.item())

    def after_optimizer_step(self) -> None:
        with torch.no_grad():
            if self.mixed:
                for p, slot, master in zip(self._params, self._slots, self._opt_tensors, strict=True):
                    local_rows(p.detach(), slot).copy_(master)
            for bucket in self._gather_buckets:
                all_gather_params(bucket, group=self.group)

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None
        for t in self._opt_tensors:
            t.grad = None

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        grads = [p.grad for p in self._params if p.grad is not None]
        grads += [t.grad for t in self._opt_tensors if t.grad is not None]
        grads += self._grad_segments
        optim: list[torch.Tensor] = []
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                optim += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return {
            "params": list(self.module.parameters()),
            "grads": grads,
            "optimizer": optim,
            "master": list(self._opt_tensors) if self.mixed else [],
        }

    # --- gradients ------------------------------------------------------------------------------------

    @abstractmethod
    def _reduce(self) -> None:
        """Leave the SUM over ranks of this rank's gradient rows where `_attach_grads` points."""

    def _attach_grads(self) -> list[torch.Tensor]:
        """Point each optimizer tensor's .grad at this rank's reduced rows; return those grads."""
        grads = []
        for i, t in enumerate(self._opt_tensors):
            b, s = self._where[i]
            if self._grad_segments:
                g = self._reduce_buckets[b].segment_view(self._grad_segments[b], s)
            else:  # stage 1, fp32: the reduced rows were written into p.grad itself
                g = local_rows(self._params[i].grad, self._slots[i])
            t.grad = g
            grads.append(g)
        return grads

    def _device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

    # --- state dicts ----------------------------------------------------------------------------------

    def _device_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            group = self.group if self.group is not None else dist.group.WORLD
            self._mesh = DeviceMesh.from_group(group, self._device().type)
        return self._mesh

    def _sharded(self, local: torch.Tensor, slot: Slot) -> torch.Tensor:
        """This rank's rows as a DTensor of the parameter's global shape (Shard(0)); a 0-dim
        parameter's value is broadcast from its owner (group rank 0) and returned as a plain tensor."""
        if len(slot.shape) == 0:
            value = local.detach().reshape(()).clone() if slot.local_rows else local.new_empty(())
            dist.broadcast(value, group=self.group, group_src=0)
            return value
        stride = torch.empty(slot.shape, device="meta").stride()
        return DTensor.from_local(
            local.detach(), self._device_mesh(), [Shard(0)], run_check=False, shape=slot.shape, stride=stride
        )

    def state_dict(self) -> dict:
        """Model: full replicated tensors keyed by FQN; in 16-bit mode the trainable parameters are the
        fp32 masters as Shard(0) DTensors (the full-precision values, as FSDP2 mixed precision saves).
        Optimizer: per-element state as Shard(0) DTensors, `step` as a plain tensor, keyed by FQN."""
        index = {n: i for i, n in enumerate(self._names)}
        model: dict[str, torch.Tensor] = {}
        for name, value in self.module.state_dict().items():
            i = index.get(name)
            if i is not None and self.mixed:
                model[name] = self._sharded(self._opt_tensors[i], self._slots[i])
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
            t, slot = self._opt_tensors[i], self._slots[i]
            entries = self.optimizer.state.get(t, {})
            state[fqn] = {
                k: self._sharded(v, slot) if _per_element(k, v, t) else v for k, v in sorted(entries.items())
            }
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
            step = self.optimizer.state[t].get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                self.optimizer.state[t]["step"] = 0

    def load_state_dict(self, state: dict) -> None:
        """Load `state_dict()`-shaped state; model entries may be full tensors or Shard(0) DTensors of
        any world size's save (dcp.load reshards them in place before this is called)."""
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
                    self._opt_tensors[i].copy_(rows)
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
            slot = self._slots[index[fqn]]
            new_state[position[fqn]] = {
                k: self._local_from(v, slot).clone() if _saved_per_element(k, v, slot) else v
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
            if sorted(saved["params"]) != sorted(names):
                raise ValueError(
                    f"checkpoint optim.param_groups[{g}].params: the saved group holds different "
                    "parameters than the optimizer's; build the optimizer with the same groups"
                )
            groups.append({**saved, "params": list(range(start, start + len(names)))})
            start += len(names)
        self.optimizer.load_state_dict({"state": new_state, "param_groups": groups})


def _slots(names: list[str], params: list[torch.Tensor], *, world_size: int, rank: int) -> list[Slot]:
    """Each parameter's own layout (offsets are per bucket; only the row split matters here)."""
    return [
        make_slot(n, p.shape, offset=0, world_size=world_size, rank=rank)
        for n, p in zip(names, params, strict=True)
    ]


def _per_element(key: str, value: Any, opt_tensor: torch.Tensor) -> bool:
    """Optimizer state shaped like its tensor (exp_avg, ...) is sharded; `step` and scalars are not."""
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == opt_tensor.shape


def _saved_per_element(key: str, value: Any, slot: Slot) -> bool:
    if isinstance(value, DTensor):
        return True
    return isinstance(value, torch.Tensor) and key != "step" and value.shape == slot.shape


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


class ZeroStage1(_Partitioned):
    """ZeRO stage 1: optimizer state partitioned; full gradients kept, reduce-scattered at the boundary."""

    holds_grad_shards = False

    def _reduce(self) -> None:
        # With overlap_comm, bucket b+1 is packed while bucket b is in flight (two flat buffers at most).
        in_flight: tuple[int, dist.Work | None, torch.Tensor, torch.Tensor] | None = None
        with torch.no_grad():
            for b, bucket in enumerate(self._reduce_buckets):
                flat = torch.empty(bucket.flat_numel, dtype=_MASTER_DTYPE, device=bucket.params[0].device)
                for s, p in enumerate(bucket.params):
                    bucket.pack(flat, s, p.grad)
                # 16-bit: reduce straight into the fp32 shards; fp32: into a segment copied into p.grad
                segment = (
                    self._grad_segments[b]
                    if self._grad_segments
                    else torch.empty(bucket.segment_numel, dtype=_MASTER_DTYPE, device=flat.device)
                )
                work = reduce_scatter(bucket, flat, segment, group=self.group, async_op=self.overlap_comm)
                if in_flight is not None:
                    self._land(*in_flight)
                in_flight = (b, work, flat, segment)
            if in_flight is not None:
                self._land(*in_flight)

    def _land(self, b: int, work: dist.Work | None, flat: torch.Tensor, segment: torch.Tensor) -> None:
        """Wait for bucket b's reduction (`flat` stays referenced until then); in fp32 mode copy this
        rank's reduced rows into p.grad, where the optimizer's views point."""
        if work is not None:
            work.wait()
        if self._grad_segments:
            return
        bucket = self._reduce_buckets[b]
        for s, p in enumerate(bucket.params):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local_rows(p.grad, bucket.slots[s]).copy_(bucket.segment_view(segment, s))


class ZeroStage2(_Partitioned):
    """ZeRO stage 2: optimizer state and gradients partitioned; gradients are reduce-scattered bucket by
    bucket during the boundary micro-step's backward and full gradients are freed as soon as packed."""

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
        n = len(self._reduce_buckets)
        self._flats: list[torch.Tensor | None] = [None] * n  # packed, not yet launched
        self._packed: list[set[int]] = [set() for _ in range(n)]
        self._next = 0  # next bucket to launch: buckets launch in order on every rank
        self._pending: list[tuple[dist.Work | None, torch.Tensor]] = []
        for p in self._params:
            # A model handed to a second strategy (initialize called again) must not keep feeding the
            # first one: its hook would pack the gradient and free p.grad before ours runs.
            previous = _GRAD_HOOKS.get(p)
            if previous is not None:
                previous.remove()
            _GRAD_HOOKS[p] = p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync:
            return  # non-boundary micro-step: keep accumulating in p.grad
        b, s = self._where[self._index[id(p)]]
        if b < self._next:
            raise RuntimeError(
                "ZeRO stage 2: a second backward reached already-reduced gradients before step(); "
                "call set_gradient_sync(False) on non-boundary micro-steps"
            )
        self._pack(b, s, p)
        while self._next < len(self._reduce_buckets) and len(self._packed[self._next]) == len(
            self._reduce_buckets[self._next].params
        ):
            self._launch(self._next)

    def _pack(self, b: int, s: int, p: torch.Tensor) -> None:
        bucket = self._reduce_buckets[b]
        flat = self._flats[b]
        if flat is None:
            flat = self._flats[b] = torch.empty(bucket.flat_numel, dtype=_MASTER_DTYPE, device=p.device)
        with torch.no_grad():
            bucket.pack(flat, s, p.grad)
        p.grad = None
        self._packed[b].add(s)

    def _launch(self, b: int) -> None:
        flat = self._flats[b]
        assert flat is not None
        work = reduce_scatter(
            self._reduce_buckets[b],
            flat,
            self._grad_segments[b],
            group=self.group,
            async_op=self.overlap_comm,
        )
        self._pending.append((work, flat))
        self._flats[b] = None
        self._next = b + 1

    def _reduce(self) -> None:
        # Flush buckets whose parameters got no gradient in the boundary backward (an unused
        # parameter, or gradients only from earlier micro-steps), in order.
        for b in range(self._next, len(self._reduce_buckets)):
            for s, p in enumerate(self._reduce_buckets[b].params):
                if s not in self._packed[b]:
                    self._pack(b, s, p)
            self._launch(b)
        for work, _ in self._pending:
            if work is not None:
                work.wait()
        self._pending.clear()
        self._packed = [set() for _ in self._reduce_buckets]
        self._next = 0
