"""Activation memory, measured from the tensors ops really create: what a forward keeps for backward, and
the high-water mark of everything created over a forward and backward.

Callers: the activation-checkpointing tests and `benchmarks/activation_checkpointing.py`. Model state
(parameters, gradients held by strategies, optimizer state) is `engine/memory.py`'s; this counts the
rest, on any device, the CPU included, where no allocator statistics exist.

How: a `TorchDispatchMode` sees every op's outputs, including ops inside checkpointed regions, their
recomputation and selective checkpointing's saved outputs. Each new output storage is counted at its
full size once, by device, and a finalizer on the storage object (torch keeps one Python object per
storage while any tensor uses it) takes it off when it is freed, so the live total is exact at every op.
Saved-tensor hooks alone cannot measure this: a checkpoint holds its inputs by reference and selective
checkpointing keeps outputs in its own cache, neither through those hooks. Hand-written for that reason.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class ActivationBytes(TorchDispatchMode):
    """`with ActivationBytes() as m:` run forward, `m.mark_forward()`, then backward; read `forward_bytes`
    (live bytes created in the window at the end of the forward: what it keeps for backward, and its
    outputs), `peak_bytes` (the most live at any op) and the same by device (`*_by_device`)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[tuple[str, int], int] = {}  # (device, storage pointer) -> bytes
        self._by_device: dict[str, int] = {}
        self.peak_bytes = 0
        self.peak_by_device: dict[str, int] = {}
        self.forward_bytes = 0
        self.forward_by_device: dict[str, int] = {}

    @property
    def live_bytes(self) -> int:
        return sum(self._by_device.values())

    def mark_forward(self) -> None:
        """Record the live bytes now (call at the end of the forward)."""
        self.forward_bytes = self.live_bytes
        self.forward_by_device = dict(self._by_device)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        key = (str(t.device), storage.data_ptr())
        if key in self._live:
            return
        self._live[key] = nbytes
        device = str(t.device)
        self._by_device[device] = self._by_device.get(device, 0) + nbytes
        weakref.finalize(storage, self._freed, key, device, nbytes)
        total = self.live_bytes
        if total > self.peak_bytes:
            self.peak_bytes = total
        if self._by_device[device] > self.peak_by_device.get(device, 0):
            self.peak_by_device[device] = self._by_device[device]

    def _freed(self, key: tuple[str, int], device: str, nbytes: int) -> None:
        if self._live.pop(key, None) is not None:
            self._by_device[device] -= nbytes
