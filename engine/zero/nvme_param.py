"""ZeRO-Infinity parameter offload to NVMe at stage 3 (`zero_optimization.offload_param.device: nvme`).

Wraps the stage-3 strategy (`zero/fsdp.py`, FSDP2) when the config asks for it (`param_offload_strategy`,
called by `engine/build.py` after the optimizer offload of `zero/nvme.py`, so both compose). This rank's
parameter shards are the local tensors of FSDP2's `DTensor` parameters; FSDP2 keeps each one in a padded
1-D storage that its all-gather reads and that the optimizer steps in place (the DTensor's local tensor
is a view of it). Between optimizer steps those storages are released (`untyped_storage().resize_(0)`)
and their bytes live in one file per FSDP unit (a transformer block, the expert layers, the root) under
`nvme_path/deepfleet-params/<job>-rank<r>/`. The tensors themselves stay the same objects, so FSDP2,
the optimizer and its state keep pointing at them.

When they are in memory, per FSDP unit:
- forward: a forward pre-hook on every unit, registered ahead of FSDP2's own (which all-gathers the
  unit), reads the unit's file back into its storages, and queues the next units in forward order
  (recorded on the first forward) on a background read-ahead thread: at most `buffer_count` units in
  flight and, past the first, at most `buffer_count * buffer_size` elements (`buffer_count: 0` reads each
  unit only when forward reaches it). Reads land in the storages themselves: no staging copies.
- between a unit's forward and its backward: a forward hook, also ahead of FSDP2's, releases the unit
  again (no write: its file already holds those bytes) and puts a hook on the unit's outputs that runs
  before FSDP2's pre-backward hook there. It reads back the unit and the one FSDP2 prefetches next (the
  unit whose forward finished just before), and queues the ones before those. The root unit stays: FSDP2
  keeps the root gathered from forward through backward. A unit whose outputs carry no gradient-requiring
  tensor keeps its shards (nothing would read them back in time). Activation checkpointing's
  recomputation inside backward releases nothing.
- the optimizer step updates every shard in memory (backward brought them all back), and `zero_grad()`
  at the end of the step writes the stepped units and releases them.
Nothing is released before the first step ends (FSDP2's lazy init re-pads the shards from their
storages in the first forward; and there is no file to read back from before the first write), so a new
engine, or one just loaded from a checkpoint, holds its shards in memory through its first step. An
evaluation forward reads each unit back and releases it as its forward ends. Units are kept in memory,
never written, in module order while their elements fit in `max_in_cpu` (DeepSpeed's "parameter elements
kept in host memory"; its default of 1e9 keeps models up to that size wholly in memory, so set it lower to
offload). Reads outside forward (`module.state_dict()`, `load_state_dict`, torch's state-dict helpers,
`deepspeed.zero.GatheredParameters`) page the shards in first; they are released at the end of the next
step.

Precision: at stage 3 the fp32 shards are the master weights (FSDP2's mixed-precision policy casts each
all-gather to the compute dtype), so there are no separate masters and the files hold the fp32 masters.
`offload_param.pin_memory` changes nothing without an accelerator (there are no device copies).

Safety is that of `zero/nvme_io.py`: a unit's file is written to `.tmp`, fsynced and renamed, so a file
under its final name is complete; a failed write keeps the unit's storages in memory and raises. A new
engine clears its directory (never trusting a killed run's files); a resumed run's shards come from the
checkpoint (the state dict pages everything in, and the loaded shards are written to fresh files).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepfleet.engine.zero.nvme_io import (
    BlockIO,
    aligned,
    check_nvme_path,
    clear_directory,
    job_name,
    storage_bytes,
)

_KEY = "zero_optimization.offload_param.nvme_path"
_ATTR = "_deepfleet_param_offload"  # on each offloaded DTensor parameter: (its NvmeParamOffload, its unit)


@dataclass
class _Unit:
    """One FSDP unit's parameter shards and where they are."""

    index: int
    module: nn.Module
    params: list[torch.Tensor]  # the unit's DTensor parameters (the optimizer's tensors)
    elements: int  # local shard elements
    persistent: bool  # kept in memory (max_in_cpu)
    resident: bool = True
    dirty: bool = True  # memory differs from the file (no file yet, or stepped since the write)
    storages: list[torch.UntypedStorage] = field(default_factory=list)  # released at the last page-out
    layout: list[tuple[int, int]] = field(default_factory=list)  # (offset, nbytes) per storage in the file


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        return p.to_local() if isinstance(p, DTensor) else p


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors inside a module's output: nested tuples, lists and dicts (Hugging Face's ModelOutput
    is a dict). Anything else yields none, and its unit then keeps its shards through backward."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _unit_storages(unit: _Unit) -> list[torch.UntypedStorage]:
    """The unit's shard storages (FSDP2's padded 1-D buffers), each once; empty shards have none."""
    seen: dict[int, torch.UntypedStorage] = {}
    for p in unit.params:
        s = _local(p).untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen[s.data_ptr()] = s
    return list(seen.values())


def fsdp_units(model: nn.Module, *, max_in_cpu: int) -> list[_Unit]:
    """Every FSDP unit of `model` in module order with the parameters it manages itself (those of its
    subtree outside nested units); units stay persistent while their elements fit in `max_in_cpu`."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    units: list[_Unit] = []
    kept = 0
    for i, m in enumerate(modules):
        nested = {id(p) for sub in m.modules() if sub is not m and isinstance(sub, FSDPModule) for p in sub.parameters()}
        params = [p for p in m.parameters() if id(p) not in nested]
        elements = sum(_local(p).numel() for p in params)
        persistent = kept + elements <= max_in_cpu
        kept += elements if persistent else 0
        units.append(_Unit(i, m, params, elements, persistent))
    return units


class NvmeParamOffload:
    """Keeps the stage-3 parameter shards of `model` in files between optimizer steps (module docstring)."""

    def __init__(self, model: nn.Module, section: Any, aio: Any, *, directory: Path) -> None:
        self.directory = directory
        self.io = BlockIO(aio, key=_KEY)
        self.buffer_count = int(section.buffer_count)
        self.buffer_elements = int(section.buffer_size)
        self.units = fsdp_units(model, max_in_cpu=int(section.max_in_cpu))
        self.order: list[int] = []  # units in the order forward reaches them
        self._position: dict[int, int] = {}
        self._recording = True
        self._reads: dict[int, Future] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="nvme-param-read")
        self._root = model
        self._in_backward = False  # from the first backward hook to the next root forward
        self._post_forward: list[int] = []  # units in the order their forward finished, this iteration
        self._hooks = [u.module.register_forward_pre_hook(self._hook(u.index), prepend=True) for u in self.units]
        # prepend: ahead of FSDP2's post-forward, so the backward hooks registered on the outputs here run
        # before the one FSDP2 registers there (which all-gathers the unit again)
        self._hooks += [u.module.register_forward_hook(self._after_hook(u.index), prepend=True) for u in self.units]
        # Whatever reads or loads the shards outside forward (module.state_dict(), torch's
        # get_model_state_dict, load_state_dict, the 16-bit model export) finds them in memory; they are
        # released again at the end of the next step. A load changes them: the next page-out writes them.
        for u in self.units:
            self._hooks += [
                u.module.register_state_dict_pre_hook(lambda *_: self.page_in_all()),
                u.module.register_load_state_dict_pre_hook(lambda *_: self.page_in_all()),
                u.module.register_load_state_dict_post_hook(lambda *_: self.mark_stepped()),
            ]
            for p in u.params:
                setattr(p, _ATTR, (self, u.index))
        clear_directory(directory)

    def _file(self, index: int) -> Path:
        return self.directory / f"unit{index:04d}.bin"

    @property
    def bytes_read(self) -> int:
        return self.io.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.io.bytes_written

    def file_bytes(self) -> int:
        """Bytes of parameter shards in this rank's files (units written at least once)."""
        return sum(self._size(u) for u in self.units if u.layout)

    def resident_elements(self) -> int:
        return sum(u.elements for u in self.units if u.resident)

    @staticmethod
    def _size(unit: _Unit) -> int:
        return aligned(unit.layout[-1][0] + unit.layout[-1][1]) if unit.layout else 0

    # ------------------------------------------------------------------ forward: page in, read ahead

    def _hook(self, index: int) -> Any:
        def before_forward(module: nn.Module, args: Any) -> None:
            self._before_forward(index)

        return before_forward

    def _after_hook(self, index: int) -> Any:
        def after_forward(module: nn.Module, args: Any, output: Any) -> None:
            self._after_forward(index, output)

        return after_forward

    def _before_forward(self, index: int) -> None:
        if self.units[index].module is self._root:  # a new forward (not a recomputation inside backward)
            self._in_backward = False
            self._post_forward = []  # a new list: hooks of an earlier forward keep theirs
        if self._recording and index not in self._position:
            self._position[index] = len(self.order)
            self.order.append(index)
        self.fetch(index)
        self._read_ahead(index)

    def fetch(self, index: int) -> None:
        """Make unit `index`'s shards resident: wait for its read-ahead, or read it now."""
        pending = self._reads.pop(index, None)
        if pending is not None:
            pending.result()
        elif not self.units[index].resident:
            self._read(index)

    def _read_ahead(self, index: int) -> None:
        pos = self._position.get(index)
        if pos is None or self.buffer_count <= 0:
            return
        in_flight = sum(self.units[j].elements for j in self._reads)
        for j in self.order[pos + 1:]:
            if len(self._reads) >= self.buffer_count:
                break
            unit = self.units[j]
            if unit.resident or j in self._reads:
                continue
            if self._reads and in_flight + unit.elements > self.buffer_count * self.buffer_elements:
                break
            self._reads[j] = self._reader.submit(self._read, j)
            in_flight += unit.elements

    def _after_forward(self, index: int, output: Any) -> None:
        """Between a unit's forward and its backward its shards are not read: release them when the file
        already holds these bytes (not before the first step's write, never the root's, which FSDP2 keeps
        gathered, nor persistent ones), and hook the outputs to read them back before backward needs them."""
        if self._in_backward:  # activation checkpointing's recomputation: the backward hooks are in place
            return
        order, pos = self._post_forward, len(self._post_forward)
        order.append(index)
        unit = self.units[index]
        if torch.is_grad_enabled():
            tensors = [t for t in _tensors(output) if t.requires_grad]
            for t in tensors:
                t.register_hook(self._backward_hook(index, order, pos))
            if not tensors:  # nothing to hook: keep the shards for whatever backward does
                return
        if unit.module is self._root or unit.persistent or unit.dirty or not unit.layout or not unit.resident:
            return
        self._release(unit)

    def _backward_hook(self, index: int, order: list[int], pos: int) -> Any:
        def before_backward(grad: torch.Tensor) -> None:
            self._before_backward(index, order, pos)

        return before_backward

    def _before_backward(self, index: int, order: list[int], pos: int) -> None:
        """Unit `index` is about to be gathered for backward, and FSDP2 prefetches the unit whose forward
        finished just before it (`order`: that forward's units as they finished; `pos`: this one's place):
        both must be resident; the ones before those are read ahead."""
        self._in_backward = True
        self.fetch(index)
        if pos > 0:
            self.fetch(order[pos - 1])
        if self.buffer_count <= 0:
            return
        for j in reversed(order[:max(0, pos - 1)]):
            if len(self._reads) >= self.buffer_count:
                break
            unit = self.units[j]
            if not unit.resident and j not in self._reads:
                self._reads[j] = self._reader.submit(self._read, j)

    def _release(self, unit: _Unit) -> None:
        storages = _unit_storages(unit)
        for s in storages:
            s.resize_(0)
        unit.storages = storages
        unit.resident = False

    def _read(self, index: int) -> None:
        unit = self.units[index]
        for s, (_, nbytes) in zip(unit.storages, unit.layout, strict=True):
            s.resize_(nbytes)
        parts = [(offset, storage_bytes(s)) for s, (offset, _) in zip(unit.storages, unit.layout, strict=True)]
        self.io.read_file(self._file(index), parts)
        unit.resident = True

    # ------------------------------------------------------------------ the step boundary

    def drain(self) -> None:
        """Wait for every read-ahead (its unit is then resident)."""
        for index in list(self._reads):
            self.fetch(index)

    def page_in_all(self) -> None:
        """Every unit resident (before a state dict is taken or loaded)."""
        self.drain()
        for unit in self.units:
            if not unit.resident:
                self._read(unit.index)

    def mark_stepped(self) -> None:
        """The resident shards changed (an optimizer step or a load): the next page-out writes them."""
        for unit in self.units:
            if unit.resident:
                unit.dirty = True

    def page_out(self) -> None:
        """Write the changed resident units to their files and release every non-persistent unit's
        storages. Raises OSError when a write fails (that unit and the ones after it stay resident)."""
        self.drain()
        if not self.order:
            # Before the first forward FSDP2 has not run its lazy init, which re-pads the shards from
            # their storages (reset_sharded_param): they must stay in memory until it has.
            return
        self._recording = False
        for unit in self.units:
            if unit.persistent or not unit.resident:
                continue
            storages = _unit_storages(unit)
            if unit.dirty or not unit.layout:
                layout, offset = [], 0
                for s in storages:
                    layout.append((offset, s.nbytes()))
                    offset = aligned(offset + s.nbytes())
                if storages:
                    self.io.write_file(self._file(unit.index), [(o, storage_bytes(s)) for s, (o, _) in
                                                                zip(storages, layout, strict=True)], size=offset)
                unit.layout = layout
                unit.dirty = False
            self._release(unit)

    def close(self) -> None:
        self.drain()
        for h in self._hooks:
            h.remove()
        self._reader.shutdown(wait=True)
        self.io.close()


def fetch_for_update(param: torch.Tensor) -> None:
    """Bring `param`'s shard back to memory for a reader outside forward that may also change it
    (`deepspeed.zero.GatheredParameters`, engine/compat/zero.py): its unit is written at the next
    page-out. A no-op for a parameter that is not offloaded."""
    ref = getattr(param, _ATTR, None)
    if ref is not None:
        offload, index = ref
        offload.fetch(index)
        offload.units[index].dirty = True


def _clone_paged(state: dict, offload: NvmeParamOffload) -> dict:
    """`state` with the model tensors that view a paged shard storage replaced by copies (the dict
    outlives the page-out that follows: a save writes from it, a load fills it)."""
    paged = {s.data_ptr() for u in offload.units if not u.persistent for s in _unit_storages(u)}
    model = {}
    for name, value in state["model"].items():
        local = _local(value) if isinstance(value, torch.Tensor) else None
        shares = local is not None and local.untyped_storage().nbytes() and local.untyped_storage().data_ptr() in paged
        model[name] = value.detach().clone() if shares else value
    return {**state, "model": model}


class ParamOffloadedStrategy:
    """The stage-3 strategy whose parameter shards live in NVMe files between steps. Delegates
    everything to the wrapped strategy; state dicts see the shards in memory."""

    def __init__(self, inner: Any, offload: NvmeParamOffload) -> None:
        self.inner = inner
        self.param_offload = offload

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def finish_gradients(self, *, grad_scale: float) -> bool:
        # The step updates every shard with a gradient: forward brought them back; a unit it skipped
        # (whose shards then have no gradient) is read too, so the step never meets a released storage.
        self.param_offload.page_in_all()
        return self.inner.finish_gradients(grad_scale=grad_scale)

    def after_optimizer_step(self) -> None:
        self.inner.after_optimizer_step()
        self.param_offload.mark_stepped()

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        self.param_offload.page_out()

    def state_dict(self) -> dict:
        self.param_offload.page_in_all()
        try:
            return _clone_paged(self.inner.state_dict(), self.param_offload)
        finally:
            self.param_offload.page_out()

    def load_state_dict(self, state: dict) -> None:
        self.param_offload.page_in_all()
        try:
            self.inner.load_state_dict(state)
        finally:
            self.param_offload.mark_stepped()  # the files are rebuilt from the checkpoint, never reused
            self.param_offload.page_out()

    def offloaded_param_bytes(self) -> int:
        """Bytes of parameter shards in this rank's offload files."""
        return self.param_offload.file_bytes()


def check_before_build(section: Any, model: nn.Module, world_size: int) -> None:
    """`check_nvme_path` at initialize, before anything is sharded: the need is this rank's share of the
    parameter elements in fp32 (the masters)."""
    elements = sum(p.numel() for p in model.parameters())
    check_nvme_path(section.nvme_path, -(-elements // max(1, world_size)) * 4, key=_KEY, what="the parameter shards")


def param_offload_strategy(sharding: Any, config: Any, *, rank: int) -> Any:
    """`sharding` wrapped for NVMe parameter offload when the config asks for it, else `sharding`."""
    section = config.zero_optimization.offload_param
    if section is None or section.device != "nvme":
        return sharding
    module = sharding.module
    units = fsdp_units(module, max_in_cpu=0)
    needed = sum(s.nbytes() for u in units for s in _unit_storages(u))
    root = check_nvme_path(section.nvme_path, needed, key=_KEY, what="the parameter shards")
    offload = NvmeParamOffload(module, section, config.aio, directory=root / "deepfleet-params" / f"{job_name()}-rank{rank}")
    return ParamOffloadedStrategy(sharding, offload)
