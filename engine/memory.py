"""Per-rank model-state memory, measured from the tensors a ZeRO strategy really holds.

Callers: the engine (`HighWater`, sampled through every step; its peak reaches the step's
`StepMetrics`), `benchmarks/zero_stages.py` and `benchmarks/zero_memory.py`, and the tests that show
what each ZeRO stage saves. Bytes come from storages, not from shapes: views that share a storage
(gradients living in DDP buckets, shards narrowed out of a padded buffer) count once, at the full size
of the storage, so padding and flat buffers are included. A storage that appears in several categories
is charged to the first of `MODEL_STATE_CATEGORIES` that holds it, so the categories add up to the total.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from deepfleet.engine.zero.base import MODEL_STATE_CATEGORIES, ZeroStrategy


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's memory on this rank is its local shard. Its `_local_tensor` is that shard itself;
    # `to_local()` would return the same storage through an autograd function, which costs ~20 us per
    # call, and the engine samples hundreds of tensors several times per step.
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def storage_bytes(tensors: Iterable[torch.Tensor], *, seen: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (each storage counted once, at its full size)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        t = _local(t)
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            continue
        key = (t.device, storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += nbytes
    return total


def model_state_bytes(tensors: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """{"params", "grads", "optimizer", "master", "total"} in bytes for one rank."""
    seen: set = set()
    report = {category: storage_bytes(tensors.get(category, []), seen=seen) for category in MODEL_STATE_CATEGORIES}
    report["total"] = sum(report.values())
    return report


def strategy_memory(sharding: ZeroStrategy) -> dict[str, int]:
    """This rank's model-state bytes under `sharding`, by category."""
    return model_state_bytes(sharding.model_state_tensors())


def fsdp_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules under `module` that `fully_shard` was applied to (stage 3), in `modules()` order."""
    return [m for m in module.modules() if callable(getattr(m, "_get_fsdp_state", None))]


def _fsdp_unsharded(modules: list[torch.nn.Module]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """FSDP2's unsharded parameters and gradients of `modules` (those `fully_shard` was applied to,
    stage 3): all-gathered parameters while a unit is unsharded, and the unsharded gradients FSDP2
    accumulates while gradient sync is off. They are model state while they live but no public API
    lists them, so this reads FSDP2's per-parameter records (`FSDPParam`); a freed storage has 0 bytes
    and is skipped by `storage_bytes`."""
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for m in modules:
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", None) or []:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                params.append(unsharded)
                if unsharded.grad is not None:
                    grads.append(unsharded.grad)
            accumulated = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            if accumulated is not None:
                grads.append(accumulated)
    return params, grads


def fsdp_resized_buffers(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
    """The tensors whose storages FSDP2 resizes in place under `modules` (stage 3): each parameter's
    all-gather output and unsharded inner tensors, allocated when a unit is gathered and resized to 0
    bytes when it is resharded. A memory tracker follows them (`LiveStorages.track(...,
    follow_resizes=True)`); their sizes change without any op that a dispatch mode sees."""
    out: list[torch.Tensor] = []
    for m in modules:
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", None) or []:
            out += list(getattr(fsdp_param, "all_gather_outputs", None) or [])
            out += list(getattr(fsdp_param, "_unsharded_inner_tensors", None) or [])
    return out


class HighWater:
    """The high-water mark of this rank's model-state bytes over a step, from real storages.

    The engine calls `sample(point)` after each forward, after each backward (every micro-step) and
    after the optimizer step; a strategy that builds transient flat buffers inside a call (stages 1/2
    reduce buckets) samples too, through its `memory_probe` attribute, while those buffers are at their
    largest, and reports them among its gradients, so a buffer that never outlives a call still
    counts. Each sample dedupes storages across categories (see `model_state_bytes`) and the largest
    total is kept, with its breakdown and the point it was taken at. `reset()` starts a new window
    (the engine does so per optimizer step)."""

    def __init__(self, strategy: ZeroStrategy) -> None:
        self._strategy = strategy
        if hasattr(strategy, "memory_probe"):
            strategy.memory_probe = self.sample
        self.last: tuple[int, dict[str, int], str | None] = (0, {}, None)
        self._fsdp: tuple[torch.nn.Module | None, list[torch.nn.Module]] = (None, [])  # (module, its FSDP modules)
        self.reset()

    def reset(self) -> None:
        """Close the window: `last` keeps (peak bytes, its breakdown, its point) of the one closed."""
        if hasattr(self, "_peak"):
            self.last = (self._peak, self.peak_report, self.peak_point)
        self._peak = 0
        self.peak_report: dict[str, int] = {}
        self.peak_point: str | None = None

    def sample(self, point: str) -> int:
        """Measure now; returns this sample's total bytes."""
        tensors = self._strategy.model_state_tensors()
        # The module's current parameters too: at stage 3 FSDP2 swaps the gathered (unsharded)
        # parameters in while a unit is unsharded, and they are model state while they live.
        module = self._strategy.module
        if self._fsdp[0] is not module:  # walking every module for FSDP state costs more than the sample
            self._fsdp = (module, fsdp_modules(module))
        unsharded_params, unsharded_grads = _fsdp_unsharded(self._fsdp[1])
        tensors["params"] = [*tensors.get("params", []), *module.parameters(), *unsharded_params]
        tensors["grads"] = [*tensors.get("grads", []), *unsharded_grads]
        report = model_state_bytes(tensors)
        if report["total"] > self._peak:
            self._peak, self.peak_report, self.peak_point = report["total"], report, point
        return report["total"]

    def peak_bytes(self) -> int:
        return self._peak


class LiveStorages:
    """Bytes of the distinct tensor storages alive now, and their high-water mark, counted as they are
    made and freed: every storage an op creates while this is active (a `TorchDispatchMode`, so
    autograd's backward ops, collectives' output buffers and optimizer steps are seen too) plus the
    tensors handed to `track` (model state that already exists when the window opens). A storage is
    released when its last reference dies (a weak reference's callback).

    Storages handed to `track(..., follow_resizes=True)` are measured again after every op: FSDP2
    frees and re-allocates a unit's gathered parameters by resizing their storages in place
    (`untyped_storage().resize_`, which no dispatch mode sees), and NVMe parameter offload does the
    same with the shards it moves to files, so their bytes are followed rather than taken once. Once
    after each op is enough: an op frees no storage its caller still holds, so the state after an op is
    never below the state just before it.

    This is what the planner's accuracy figure is measured with on a CPU build, where torch keeps no
    allocator statistics (`torch.cuda.max_memory_allocated` has no CPU twin): it sees activations and
    temporaries, which `HighWater` (model state only) does not. Use as a context manager; `peak` and
    `current` are in bytes."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                out = func(*args, **(kwargs or {}))
                tracker._track_tree(out)
                tracker._follow_resizes()  # after the op: it sees a resize made before it as well
                return out

        self._mode = _Mode()
        self._live: dict[int, object] = {}  # storage key -> weak reference
        self._bytes: dict[int, int] = {}  # storage key -> the bytes counted for it
        self._followed: set[int] = set()  # keys re-measured around every op
        self.current = 0
        self.peak = 0

    def __enter__(self) -> LiveStorages:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak = self.current

    def track(self, tensors: Iterable[torch.Tensor], *, follow_resizes: bool = False) -> None:
        for t in tensors:
            self._track_one(t, follow=follow_resizes)

    def _track_tree(self, out: object) -> None:
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track_one(t)

    def _follow_resizes(self) -> None:
        for key in self._followed:
            storage = self._live[key]()
            if storage is None:
                continue
            nbytes = storage.nbytes()
            if nbytes != self._bytes[key]:
                self.current += nbytes - self._bytes[key]
                self._bytes[key] = nbytes
        self.peak = max(self.peak, self.current)

    def _track_one(self, t: torch.Tensor, *, follow: bool = False) -> None:
        import weakref

        t = _local(t)
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return  # a wrapper subclass (DTensor, fake): its inner tensors are seen on their own
        storage = t.untyped_storage()
        key = storage._cdata  # the StorageImpl's address: unique while alive, also on meta
        if key not in self._live:

            def released(_ref: object, key: int = key) -> None:
                if self._live.pop(key, None) is not None:
                    self._followed.discard(key)
                    self.current -= self._bytes.pop(key)

            self._live[key] = weakref.ref(storage, released)
            self._bytes[key] = storage.nbytes()
            self.current += self._bytes[key]
        if follow:
            self._followed.add(key)
        self.peak = max(self.peak, self.current)
