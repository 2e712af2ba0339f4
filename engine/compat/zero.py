"""`deepspeed.zero.Init`, `deepspeed.zero.GatheredParameters` and `ZeroParamStatus`, over this engine's
ZeRO-3 (FSDP2 `fully_shard`, parameters as `DTensor` shards on dim 0).

- `Init(...)`: as in DeepSpeed, each parameter is partitioned over the data-parallel ranks the moment the
  module that created it finishes its `__init__` (engine/zero/construction.py): the parameter keeps only
  this rank's rows in `ds_tensor` and holds an empty placeholder, so the whole model never exists on one
  rank. `initialize` at stage 3 hands the rows to FSDP2 without making them whole; at stages 0-2 it makes
  the parameters whole first. `dtype` casts new floating parameters. Without a process group (one
  process) nothing is partitioned.
- `GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)`: inside the context
  the listed parameters are whole on every rank: a stage-3 shard is all-gathered and the full tensor is
  put on its module under the same name, so `module.weight` reads (and, on `modifier_rank`, writes) the
  whole weight; a parameter partitioned by `Init` is made whole in place. On exit the modifier rank's
  values are broadcast and each rank's shard is refreshed from them, and the sharded parameter goes back.
  Plain (unsharded) parameters stay as they are and are broadcast from `modifier_rank` on exit. Owners of
  shards are found in the modules of engines built in this process (`register_module`, called by
  `initialize`).
"""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from deepfleet.engine import comm
from deepfleet.engine.zero import construction
from deepfleet.engine.zero.nvme_param import fetch_for_update

_MODULES: list[weakref.ref] = []  # the user modules of engines built in this process


def register_module(module: nn.Module) -> None:
    """Called by `engine.initialize`: where `GatheredParameters` looks for the owners of shards."""
    _MODULES[:] = [r for r in _MODULES if r() is not None] + [weakref.ref(module)]


class ZeroParamStatus(enum.Enum):
    """A ZeRO-3 parameter's state, DeepSpeed's names: whole on this rank, partitioned, or being gathered."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


class Init(contextlib.ContextDecorator):
    """`with deepspeed.zero.Init(config_dict_or_path=ds_config): model = Model()` (see module docstring)."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 dtype: torch.dtype | None = None, mpu: Any = None, zero_param_parallel_group: Any = None,
                 zero_quantized_weights: bool = False, zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None) -> None:
        if remote_device not in (None, "none", "cpu"):
            raise ValueError(f"remote_device: {remote_device!r} is not supported; use None or 'cpu'")
        if mpu is not None:
            raise ValueError("mpu: model-parallel units are not supported; drop the mpu argument")
        if zero_quantized_weights or zero_quantized_nontrainable_weights:
            raise ValueError("zero_quantized_weights: not supported; drop it")
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"dtype: {dtype} is not a floating dtype")
        self.enabled = enabled
        self.dtype = dtype
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        self.group = data_parallel_group if data_parallel_group is not None else construction.default_group()
        self._hook: Any = None
        self._partitioning: Any = None
        if module is not None and enabled:  # DeepSpeed's form for a model built already: partition it now
            if dtype is not None:
                module.to(dtype)
            if self._partitions():
                for p in module.parameters():
                    construction.partition_param(p, self.group)

    def _partitions(self) -> bool:
        return self.group is not None and comm.get_world_size(self.group) > 1

    def _cast(self, module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is not None and param.is_floating_point() and param.dtype != self.dtype:
            return nn.Parameter(param.detach().to(self.dtype), requires_grad=param.requires_grad)
        return None

    def __enter__(self) -> Init:
        if self.enabled and self.dtype is not None:
            self._hook = nn.modules.module.register_module_parameter_registration_hook(self._cast)
        if self.enabled and self._partitions():
            self._partitioning = construction.partitioning(self.group)
            self._partitioning.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        if self._partitioning is not None:
            self._partitioning.__exit__(*exc)
            self._partitioning = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        return False


_orig_torch_arange = torch.arange  # DeepSpeed's name; integrations compare constructors against it


def zero_wrapper_for_fp_tensor_constructor(fn: Any, target_fp_dtype: torch.dtype,
                                           target_device: torch.device | str | None = None) -> Any:
    """DeepSpeed's constructor wrapper: `fn` (a tensor constructor) creating its result on `target_device`
    and casting floating results to `target_fp_dtype`. `Init` here does not wrap torch's constructors;
    integrations that swap this function around `Init` (Hugging Face's `prevent_arange_dtype_change`)
    find it with DeepSpeed's signature."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped


def _owners(param: torch.Tensor) -> list[tuple[nn.Module, str]]:
    found = []
    for ref in _MODULES:
        root = ref()
        if root is None:
            continue
        for module in root.modules():
            for name, p in module.named_parameters(recurse=False):
                if p is param:
                    found.append((module, name))
    return found


def _as_list(params: Any) -> list[torch.Tensor]:
    if params is None:
        return []
    if isinstance(params, torch.Tensor):
        return [params]
    return [p for p in params if p is not None]


class GatheredParameters(contextlib.ContextDecorator):
    """`with deepspeed.zero.GatheredParameters(params, modifier_rank=0): ...` (see module docstring)."""

    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None,
                 fwd_module: nn.Module | None = None, enabled: bool = True) -> None:
        self.params = _as_list(params)
        self.modifier_rank = modifier_rank
        self.enabled = enabled and dist.is_initialized()
        self._swapped: list[tuple[DTensor, nn.Parameter, list[tuple[nn.Module, str]]]] = []
        self._whole: list[nn.Parameter] = []  # Init's partitioned parameters made whole here

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        for p in self.params:
            if construction.is_partitioned(p):  # partitioned by Init: whole in place
                construction.make_whole(p)
                self._whole.append(p)
            elif isinstance(p, DTensor):
                fetch_for_update(p)  # a shard kept in NVMe files between steps is read back first
                owners = _owners(p)
                full = nn.Parameter(p.full_tensor().detach().clone(), requires_grad=p.requires_grad)
                for module, name in owners:
                    setattr(module, name, full)
                self._swapped.append((p, full, owners))
        return self

    def __exit__(self, *exc: Any) -> bool:
        if not self.enabled:
            return False
        with torch.no_grad():
            for p in self._whole:
                if self.modifier_rank is not None:
                    comm.broadcast(p.data, group=p.ds_group, group_src=self.modifier_rank)
                construction.repartition_param(p)
            for p in self._plain():
                if self.modifier_rank is not None:
                    dist.broadcast(p.data, src=self.modifier_rank)
            for sharded, full, owners in self._swapped:
                if self.modifier_rank is not None:
                    dist.broadcast(full.data, src=self.modifier_rank, group=sharded.device_mesh.get_group())
                    self._refresh_shard(sharded, full.data)
                for module, name in owners:
                    setattr(module, name, sharded)
        self._swapped, self._whole = [], []
        return False

    def _plain(self) -> Iterator[torch.Tensor]:
        whole = {id(p) for p in self._whole}
        return (p for p in self.params if not isinstance(p, DTensor) and id(p) not in whole)

    @staticmethod
    def _refresh_shard(sharded: DTensor, full: torch.Tensor) -> None:
        # FSDP2 shards dim 0 with torch.chunk's split: rank r holds chunk r (possibly empty)
        mesh = sharded.device_mesh
        chunks = torch.chunk(full, mesh.size(), dim=0)
        rank = mesh.get_local_rank()
        local = sharded.to_local()
        if rank < len(chunks) and local.numel():
            local.copy_(chunks[rank].reshape(local.shape).to(local.dtype))
