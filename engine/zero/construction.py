"""Parameters partitioned while the model is built (`deepspeed.zero.Init`), and their adoption by the
strategies.

Inside `Init` every `nn.Module` subclass's `__init__` is wrapped: when a module's `__init__` returns (its
own initialisation done), each of its direct parameters keeps only this rank's rows — `torch.chunk` of
dim 0 over the data-parallel ranks, FSDP2's `Shard(0)` split — in `param.ds_tensor`, and the parameter
itself (the same object, so optimizers and param groups built from it still name it) holds an empty
tensor, DeepSpeed's placeholder, with `ds_shape`, `ds_numel` and `ds_status`. So the whole model never
exists on one rank: peak memory while building is this rank's shards plus the largest single module's
parameters.

Adoption (`engine.initialize`): at stage 3, `FSDPStrategy` shards the meta model with `fully_shard`,
allocates it (`to_empty`) and copies each rank's rows into FSDP2's local shard (`adopt_into_fsdp`); at
stages 0-2 the rows are gathered into whole parameters first (`gather_whole`). `GatheredParameters`
makes partitioned parameters whole inside its context (`gather_param` / `repartition_param`).

Written here because torch has no construction-time sharding: `fully_shard` needs the built module, and
meta-device construction loses the initial values a model's own `__init__` sets.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepfleet.engine import comm


def is_partitioned(p: torch.Tensor) -> bool:
    """True for a parameter partitioned by `Init` and not yet adopted."""
    return getattr(p, "ds_tensor", None) is not None


def _rows(full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(full, size, dim=0)
    if rank < len(chunks):
        return chunks[rank].detach().clone()
    return full.new_empty((0, *full.shape[1:]))


def partition_param(p: nn.Parameter, group: Any) -> None:
    """Keep this rank's rows of `p` in `p.ds_tensor`; `p` becomes a meta placeholder of the full shape."""
    from deepfleet.engine.compat.zero import ZeroParamStatus

    if p.dim() == 0 or is_partitioned(p) or p.device.type == "meta":
        return
    size, rank = comm.get_world_size(group), comm.get_rank(group)
    shard = _rows(p.detach(), size, rank)
    p.ds_shape, p.ds_numel, p.ds_group = tuple(p.shape), p.numel(), group
    p.ds_tensor = shard
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
    freed = p.numel() * p.element_size()
    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    if p.device.type == "cpu" and freed >= _TRIM_BYTES:
        _release_host_memory()


_TRIM_BYTES = 1 << 20


def _release_host_memory() -> None:
    """Give the freed whole tensor's pages back (glibc keeps freed heap memory resident, so without this
    the resident set would not shrink as parameters are partitioned and the construction peak would stay
    near the whole model's); a no-op where the C library has no `malloc_trim`."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM: Any = None


def gather_param(p: nn.Parameter) -> torch.Tensor:
    """The whole tensor of a partitioned parameter from every rank's rows (collective over its group)."""
    group = p.ds_group
    shard = p.ds_tensor.to(device=p.device, dtype=p.dtype)  # the placeholder follows .to(); the rows catch up
    size = comm.get_world_size(group)
    rows = -(-p.ds_shape[0] // size)
    padded = shard.new_zeros((rows, *p.ds_shape[1:]))
    padded[: shard.shape[0]] = shard
    parts = [torch.empty_like(padded) for _ in range(size)]
    comm.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat(parts, dim=0)[: p.ds_shape[0]]


def make_whole(p: nn.Parameter) -> None:
    """Turn a partitioned parameter back into a whole one (collective)."""
    from deepfleet.engine.compat.zero import ZeroParamStatus

    p.data = gather_param(p)
    p.ds_tensor = None
    p.ds_status = ZeroParamStatus.AVAILABLE


def repartition_param(p: nn.Parameter) -> None:
    """After `make_whole`: keep this rank's rows of the (possibly changed) whole tensor again."""
    from deepfleet.engine.compat.zero import ZeroParamStatus

    group = p.ds_group
    p.ds_tensor = _rows(p.detach(), comm.get_world_size(group), comm.get_rank(group))
    p.ds_status = ZeroParamStatus.NOT_AVAILABLE
    p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def partitioned_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if is_partitioned(p)]


def gather_whole(model: nn.Module) -> None:
    """Stages 0-2: every partitioned parameter of `model` made whole again (collective)."""
    for p in partitioned_params(model):
        make_whole(p)


def adopt_into_fsdp(model: nn.Module, shard: Any, *, group: Any) -> None:
    """Stage 3: `shard()` applies `fully_shard` to the model; partitioned parameters arrive as FSDP2's
    local shards without ever being whole. Each placeholder is swapped for a `meta` parameter of its full
    shape under the same name before `fully_shard` (which needs the shapes), the model is allocated after
    it, and every rank's rows are copied in; parameters built outside `Init` are partitioned first (from
    their whole values), buffers are kept."""
    size = comm.get_world_size(group)
    mismatched = {comm.get_world_size(p.ds_group) for p in partitioned_params(model)} - {size}
    if mismatched:
        raise ValueError(f"zero.Init: parameters were partitioned over {sorted(mismatched)} ranks but ZeRO-3 "
                         f"shards over {size}; build the model under Init(data_parallel_group=<the data-parallel "
                         "group>) or without it")
    for p in model.parameters():
        partition_param(p, group)  # 0-dim parameters stay whole
    rows = {n: (p.ds_tensor if is_partitioned(p) else p.detach().clone()) for n, p in model.named_parameters()}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    device = next(model.parameters()).device  # where initialize moved the (empty) placeholders
    placeholders: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and is_partitioned(p):
                if id(p) not in placeholders:  # tied parameters stay one parameter
                    placeholders[id(p)] = nn.Parameter(torch.empty(p.ds_shape, dtype=p.dtype, device="meta"),
                                                       requires_grad=p.requires_grad)
                module._parameters[name] = placeholders[id(p)]
    shard()
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            source = rows.get(name)
            if source is not None and local.numel():
                local.copy_(source.reshape(local.shape).to(local.dtype))
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])


# ------------------------------------------------------------------------------------------ the context

_DEPTH = 0
_WRAPPED: list[tuple[type, Any]] = []
_GROUP: Any = None


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _wrap(cls: type) -> None:
    original = cls.__dict__.get("__init__")
    if original is None or getattr(original, "_deepfleet_init_wrapper", False):
        return

    def init(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if _outermost(self, cls):  # a subclass's own __init__ may still set values after super().__init__
            for p in self.parameters(recurse=False):
                partition_param(p, _GROUP)

    init._deepfleet_init_wrapper = True  # type: ignore[attr-defined]
    init.__wrapped__ = original  # type: ignore[attr-defined]
    cls.__init__ = init
    _WRAPPED.append((cls, original))


def _outermost(module: nn.Module, cls: type) -> bool:
    """True when `cls` is the most derived class of `module` that defines `__init__` (its init ran last)."""
    for klass in type(module).__mro__:
        if "__init__" in klass.__dict__:
            return klass is cls
    return False


@contextlib.contextmanager
def partitioning(group: Any) -> Iterator[None]:
    """While inside: modules partition their parameters over `group` as their `__init__` returns."""
    global _DEPTH, _GROUP
    if _DEPTH == 0:
        _GROUP = group
        for cls in [nn.Module, *_subclasses(nn.Module)]:
            if cls is not nn.Module:
                _wrap(cls)
    _DEPTH += 1
    try:
        yield
    finally:
        _DEPTH -= 1
        if _DEPTH == 0:
            for cls, original in reversed(_WRAPPED):
                cls.__init__ = original
            _WRAPPED.clear()
            _GROUP = None


def default_group() -> Any:
    return dist.group.WORLD if dist.is_initialized() else None
