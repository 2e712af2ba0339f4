"""ZeRO-Infinity optimizer-state offload to NVMe (`zero_optimization.offload_optimizer.device: nvme`).

Wraps any ZeRO strategy of stages 1-3 (`offload_strategy`, called by `engine/build.py`). Between
optimizer steps this rank's per-element optimizer state (Adam's `exp_avg`, `exp_avg_sq`, ...) lives in
files under `nvme_path/deepfleet-optimizer/<job>-rank<r>/`, one file per chunk of optimizer tensors
(`sub_group_size` elements of parameters per chunk, DeepSpeed's stage-3 step tile). Each step reads the
chunks back one by one into a pool of `buffer_count` host buffers, steps the *same torch optimizer* over
that chunk only (its param groups narrowed to the chunk's tensors, the state dict holding views of the
buffer), and writes the chunk back. With `pipeline_read` the next chunk is read on a background thread
while the current one steps; with `pipeline_write` a chunk's write runs in the background and its buffer
returns to the pool when the write completes (DeepSpeed's meanings). Scalars (`step`) stay in memory.

The block I/O (`aio` keys), the atomic writes and the directory checks are `engine/zero/nvme_io.py`'s,
shared with the stage-3 parameter offload (`engine/zero/nvme_param.py`).

Safety: a chunk is written to `<name>.tmp`, fsynced and renamed over `<name>`, so a file that exists
under its final name is always complete. Files are never trusted across engines: a new engine clears its
directory (stale chunks and `.tmp` leftovers of a killed run), and the state of a resumed run is rebuilt
from the checkpoint, which is written out to fresh files at load. The directory is checked at build time
(exists, is a directory, is writable, has room for the state by `shutil.disk_usage`).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepfleet.engine.zero.nvme_io import BlockIO, aligned, clear_directory, job_name
from deepfleet.engine.zero.nvme_io import check_nvme_path as _check_path

_KEY = "zero_optimization.offload_optimizer.nvme_path"


@dataclass
class _Entry:
    """One offloaded state tensor inside a chunk file."""

    tensor: int  # index of the optimizer tensor
    key: str  # its state name
    dtype: torch.dtype
    shape: torch.Size
    offset: int  # byte offset in the chunk file
    nbytes: int
    spec: Any  # (device_mesh, placements, global shape, global stride) for a DTensor, else None


def _view(buf: bytearray, e: _Entry) -> torch.Tensor:
    """The entry's tensor inside `buf` (an empty shard, as a rank may hold, is a fresh empty tensor)."""
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=e.dtype)
    count = e.nbytes // torch.empty((), dtype=e.dtype).element_size()
    return torch.frombuffer(buf, dtype=e.dtype, count=count, offset=e.offset).view(e.shape)


def _is_dtensor(v: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(v, DTensor)


def _local(v: torch.Tensor) -> torch.Tensor:
    return v.to_local() if _is_dtensor(v) else v


def _per_element(value: Any, tensor: torch.Tensor) -> bool:
    """State that scales with the tensor (offloaded), as opposed to scalars such as `step`."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == tensor.shape


def check_nvme_path(path: str | None, needed_bytes: int) -> Path:
    """The optimizer offload directory, or a one-line ValueError naming the key and the fix."""
    return _check_path(path, needed_bytes, key=_KEY, what="the optimizer state")


def check_before_build(section: Any, model: torch.nn.Module, world_size: int) -> None:
    """`check_nvme_path` at initialize, before anything is sharded: the need is estimated as this rank's
    share of the trainable fp32 elements times two moments (Adam's)."""
    elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
    check_nvme_path(section.nvme_path, -(-elements // max(1, world_size)) * 4 * 2)


def _states_per_element(optimizer: torch.optim.Optimizer) -> int:
    """Per-element state tensors the optimizer keeps (for the free-space check before the first write)."""
    amsgrad = any(g.get("amsgrad", False) for g in optimizer.param_groups)
    if isinstance(optimizer, torch.optim.SGD):
        return 1
    return 3 if amsgrad else 2


class _Buffers:
    """A bounded pool of `count` reusable host buffers (bytearrays grown to the largest chunk)."""

    def __init__(self, count: int) -> None:
        self._free = [bytearray() for _ in range(max(1, count))]
        self._cv = threading.Condition()

    def take(self, nbytes: int) -> bytearray:
        with self._cv:
            while not self._free:
                self._cv.wait()
            buf = self._free.pop()
        if len(buf) < nbytes:
            try:
                buf.extend(bytes(nbytes - len(buf)))
            except BufferError:  # a tensor still views it: leave it to that tensor, use a new one
                buf = bytearray(nbytes)
        return buf

    def give(self, buf: bytearray) -> None:
        with self._cv:
            self._free.append(buf)
            self._cv.notify()


def _offloaded_step(self: torch.optim.Optimizer, closure: Any = None) -> Any:
    self._opt_called = True  # what torch's LR schedulers' own step wrapper records
    return self._deepfleet_nvme.step(closure)


def _install_step(optimizer: torch.optim.Optimizer, offload: NvmeOptimizerOffload) -> Any:
    """Route `optimizer.step` through `offload` and return the optimizer's own step.

    The optimizer's class is swapped for a subclass whose `step` is the chunked one (not an instance
    attribute: torch's LR schedulers re-bind `type(opt).step`'s function to the optimizer). An instance
    `step` set before (a scheduler built on the user's optimizer) is dropped, or it would bypass this."""
    cls = type(optimizer)
    own = cls.step.__get__(optimizer, cls)
    optimizer.__dict__.pop("step", None)
    optimizer._deepfleet_nvme = offload  # type: ignore[attr-defined]
    optimizer.__class__ = type(cls.__name__, (cls,), {"step": _offloaded_step, "__module__": cls.__module__,
                                                      "__qualname__": cls.__qualname__})
    return own


class NvmeOptimizerOffload:
    """Keeps `optimizer`'s per-element state in chunk files between steps (see the module docstring).

    `optimizer.step` becomes the chunked step (`_install_step`). While `resident` (between
    `materialize()` and `offload_all()`), the state is in memory and `step` is the optimizer's own."""

    def __init__(self, optimizer: torch.optim.Optimizer, section: Any, aio: Any, *, chunk_elements: int,
                 directory: Path) -> None:
        self.optimizer = optimizer
        self.directory = directory
        self.chunk_elements = max(1, chunk_elements)
        self.io = BlockIO(aio, key=_KEY)
        self.pipeline_read = bool(section.pipeline_read)
        self.pipeline_write = bool(section.pipeline_write)
        self.buffers = _Buffers(int(section.buffer_count))
        self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="nvme-prefetch")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="nvme-write")
        self.tensors = [t for g in optimizer.param_groups for t in g["params"]]
        self.chunks = self._chunks()
        self.layout: dict[int, list[_Entry]] = {}  # chunk -> what its file holds
        self.scalars: dict[int, dict[str, Any]] = {}  # tensor -> state kept in memory (step)
        self._writes: dict[int, Future] = {}
        self.resident = False
        self._step = _install_step(optimizer, self)
        clear_directory(directory)  # never trusted: a new engine's state comes from memory or a checkpoint

    @property
    def bytes_read(self) -> int:
        return self.io.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.io.bytes_written

    def _chunks(self) -> list[list[int]]:
        chunks: list[list[int]] = []
        size = 0
        for i, t in enumerate(self.tensors):
            n = _local(t).numel()
            if chunks and size + n <= self.chunk_elements:
                chunks[-1].append(i)
                size += n
            else:
                chunks.append([i])
                size = n
        return chunks

    def _file(self, chunk: int) -> Path:
        return self.directory / f"chunk{chunk:05d}.bin"

    # ------------------------------------------------------------------ files

    def _write_file(self, chunk: int, buf: bytearray, nbytes: int) -> None:
        self.io.write_file(self._file(chunk), [(0, memoryview(buf)[:nbytes])])

    def _read_file(self, chunk: int) -> bytearray:
        entries = self.layout[chunk]
        nbytes = aligned(entries[-1].offset + entries[-1].nbytes)
        pending = self._writes.pop(chunk, None)
        if pending is not None:
            pending.result()
        buf = self.buffers.take(nbytes)
        self.io.read_file(self._file(chunk), [(0, memoryview(buf)[:nbytes])])
        return buf

    # ------------------------------------------------------------------ state <-> buffers

    def _views(self, chunk: int, buf: bytearray) -> dict[int, dict[str, torch.Tensor]]:
        from torch.distributed.tensor import DTensor

        out: dict[int, dict[str, torch.Tensor]] = {}
        for e in self.layout[chunk]:
            local = _view(buf, e)
            if e.spec is not None:
                mesh, placements, shape, stride = e.spec
                value: torch.Tensor = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                                                         stride=stride)
            else:
                value = local
            out.setdefault(e.tensor, {})[e.key] = value
        return out

    def _install(self, chunk: int, buf: bytearray | None, *, copy: bool) -> None:
        views = self._views(chunk, buf) if buf is not None else {}
        for i in self.chunks[chunk]:
            entries = dict(self.scalars.get(i, {}))
            for key, v in views.get(i, {}).items():
                entries[key] = v.clone() if copy else v
            if entries:
                self.optimizer.state[self.tensors[i]] = entries

    def _pack(self, chunk: int, reuse: bytearray | None = None) -> tuple[bytearray, int] | None:
        """Move the chunk's per-element state from `optimizer.state` into a buffer (`reuse`, the one it
        was read into and stepped in place, when the layout is unchanged); scalars stay here."""
        before = self.layout.get(chunk)
        entries: list[_Entry] = []
        offset = 0
        sources = []
        for i in self.chunks[chunk]:
            t = self.tensors[i]
            state = self.optimizer.state.pop(t, None)
            if not state:
                continue
            kept = {}
            for key, v in sorted(state.items()):
                if _per_element(v, t):
                    local = _local(v)
                    spec = (v.device_mesh, v.placements, v.shape, v.stride()) if _is_dtensor(v) else None
                    nbytes = local.numel() * local.element_size()
                    entries.append(_Entry(i, key, local.dtype, local.shape, offset, nbytes, spec))
                    sources.append(local)
                    offset = aligned(offset + nbytes)
                else:
                    kept[key] = v
            self.scalars[i] = kept
        self.layout[chunk] = entries
        same = reuse is not None and before == entries
        if reuse is not None and not same:
            self.buffers.give(reuse)
        if not entries:
            return None
        buf = reuse if same else self.buffers.take(offset)
        for e, src in zip(entries, sources, strict=True):
            dst = _view(buf, e)
            if e.nbytes and dst.data_ptr() != src.data_ptr():  # stepped in place in this very buffer: nothing to copy
                dst.copy_(src)
        return buf, offset

    def _put(self, chunk: int, packed: tuple[bytearray, int] | None, *, background: bool) -> None:
        if packed is None:
            self._file(chunk).unlink(missing_ok=True)
            return
        buf, nbytes = packed

        def write() -> None:
            try:
                self._write_file(chunk, buf, nbytes)
            finally:
                self.buffers.give(buf)

        if background:
            self._writes[chunk] = self._writer.submit(write)
        else:
            write()

    def wait(self) -> None:
        """Block until every background write has landed under its final name."""
        self._drain()

    def _drain(self) -> None:
        for f in list(self._writes.values()):
            f.result()
        self._writes.clear()

    # ------------------------------------------------------------------ the step and the transitions

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        if self.resident:
            return self._step(closure)
        if closure is not None:
            raise ValueError("optimizer.step(closure): not supported with offload_optimizer.device \"nvme\"")
        groups = [list(g["params"]) for g in self.optimizer.param_groups]
        index = {id(t): i for i, t in enumerate(self.tensors)}

        def fetch(chunk: int) -> bytearray | None:
            return self._read_file(chunk) if self.layout.get(chunk) else None

        ahead: Future | None = None
        try:
            for k, members in enumerate(self.chunks):
                buf = ahead.result() if ahead is not None else fetch(k)
                ahead = None
                if self.pipeline_read and k + 1 < len(self.chunks):
                    ahead = self._prefetch.submit(fetch, k + 1)
                self._install(k, buf, copy=False)
                wanted = set(members)
                for g, params in zip(self.optimizer.param_groups, groups, strict=True):
                    g["params"] = [t for t in params if index[id(t)] in wanted]
                self._step()
                packed = self._pack(k, reuse=buf)
                self._put(k, packed, background=self.pipeline_write)
        finally:
            if ahead is not None:
                extra = ahead.result()
                if extra is not None:
                    self.buffers.give(extra)
            for g, params in zip(self.optimizer.param_groups, groups, strict=True):
                g["params"] = params
        return None

    def materialize(self) -> None:
        """Read every chunk back into ordinary in-memory state (for a state dict); `step` is then the
        optimizer's own until `offload_all()`."""
        if self.resident:
            return
        self._drain()
        for k in range(len(self.chunks)):
            if self.layout.get(k):
                buf = self._read_file(k)
                try:
                    self._install(k, buf, copy=True)
                finally:
                    self.buffers.give(buf)
            else:
                self._install(k, None, copy=False)
        self.resident = True

    def offload_all(self) -> None:
        """Write the in-memory state (e.g. just loaded from a checkpoint) to fresh chunk files and drop it."""
        self._drain()
        for k in range(len(self.chunks)):
            self._put(k, self._pack(k), background=False)
        self.resident = False

    def close(self) -> None:
        self._drain()
        for pool in (self._prefetch, self._writer):
            pool.shutdown(wait=True)
        self.io.close()


class OffloadedStrategy:
    """A ZeRO strategy whose optimizer state lives in NVMe files between steps. Delegates everything
    to the wrapped strategy; state dicts see the state read back in memory."""

    def __init__(self, inner: Any, offload: NvmeOptimizerOffload) -> None:
        self.inner = inner
        self.offload = offload

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def state_dict(self) -> dict:
        self.offload.materialize()
        try:
            return self.inner.state_dict()
        finally:
            # the returned dict keeps its tensors (a save or a load target); the optimizer lets go of them
            self.offload.offload_all()

    def load_state_dict(self, state: dict) -> None:
        self.offload.materialize()
        try:
            self.inner.load_state_dict(state)
        finally:
            self.offload.offload_all()  # the files are rebuilt from the checkpoint, never reused

    def offloaded_optimizer_bytes(self) -> int:
        """Bytes of optimizer state in this rank's offload files."""
        return sum(aligned(e[-1].offset + e[-1].nbytes) for e in self.offload.layout.values() if e)


def offload_strategy(sharding: Any, optimizer: torch.optim.Optimizer, config: Any, *, rank: int) -> Any:
    """`sharding` wrapped for NVMe optimizer offload when the config asks for it, else `sharding`."""
    zero = config.zero_optimization
    section = zero.offload_optimizer
    if section is None or section.device != "nvme":
        return sharding
    tensors = [t for g in optimizer.param_groups for t in g["params"]]
    elements = sum(_local(t).numel() for t in tensors)
    itemsize = max((t.element_size() for t in tensors), default=4)
    # the exact need of this rank's shard (build_training checked the estimate before the strategy)
    root = check_nvme_path(section.nvme_path, elements * itemsize * _states_per_element(optimizer))
    directory = root / "deepfleet-optimizer" / f"{job_name()}-rank{rank}"
    offload = NvmeOptimizerOffload(optimizer, section, config.aio, chunk_elements=zero.sub_group_size,
                                   directory=directory)
    return OffloadedStrategy(sharding, offload)
