"""FLOP counting through `torch.utils.flop_counter.FlopCounterMode`, per module, with honest attention.

Called by `flops_profiler.py` (the standalone `get_model_profile` and the engine's `profile_step`) and
by `step_flops.py` (MFU per step). One `FlopCount` accumulates any number of counted regions (each
forward and backward of an accumulation window), keyed by module path as `model.named_modules()`
spells it ("" is the root), so per-module reports and totals come from one pass.

Ops torch's table does not know (norms, activations, softmax, embeddings) count 0, as in torch's table;
they are not matmul FLOPs. Attention uses `attention_formulas()` (causal and masked pairs only).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from deepfleet.engine.profiling.attention_flops import attention_formulas, kept_pairs

GLOBAL = "Global"  # FlopCounterMode's key for everything counted, inside a module or not
MASK_CORRECTION = "attention_mask_correction"  # the op key under which the math path's masked pairs are removed


class FlopCount:
    """FLOPs counted in the regions run under `count(...)`, in total and per module path."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self.total = 0
        self.by_phase: dict[str, int] = defaultdict(int)
        self.per_module: dict[str, int] = defaultdict(int)
        self.per_op: dict[str, int] = defaultdict(int)
        self._root = type(model).__name__ if model is not None else None
        self._formulas = attention_formulas()
        self._active: FlopCounterMode | None = None

    def _adjust(self, delta: int, *, modules: bool) -> None:
        """Add `delta` FLOPs to the open region (and to the modules it is inside, in a forward)."""
        mode = self._active
        if mode is None or not delta:
            return
        names = set(mode.mod_tracker.parents) if modules else set()
        for name in names | {GLOBAL}:
            mode.flop_counts[name][MASK_CORRECTION] += delta

    @contextmanager
    def count(self, phase: str = "forward") -> Iterator[None]:
        """Count every op run inside the block and add it to the totals and to `phase`'s; per-module
        counts are kept for forward phases only (the module report, as DeepSpeed's, is of the forward)."""
        mode = FlopCounterMode(display=False, custom_mapping=self._formulas)
        self._active = mode
        try:
            with mode, _AttentionCorrection(self):
                yield
        finally:
            self._active = None
        for name, ops in mode.get_flop_counts().items():
            flops = sum(ops.values())
            if name == GLOBAL:
                self.total += flops
                self.by_phase[phase] += flops
                for op, n in ops.items():
                    self.per_op[str(op)] += n
                continue
            path = self._path(name)
            if path is not None and phase == "forward":
                self.per_module[path] += flops

    def _path(self, tracker_name: str) -> str | None:
        """ModuleTracker's "TinyGPT.blocks.0" (or "DistributedDataParallel.module.blocks.0") -> "blocks.0";
        None for names outside the model."""
        if self._root is None:
            return tracker_name
        parts = tracker_name.split(".")
        if parts[0] == self._root:
            return ".".join(parts[1:])
        if len(parts) >= 2 and parts[1] == "module":  # a wrapper (DDP) whose `.module` is the model
            return ".".join(parts[2:])
        return None


class _AttentionCorrection(TorchFunctionMode):
    """Makes the unfused (math) SDPA path count only the pairs attention computes.

    The fused kernels are counted by `attention_formulas()`; when torch falls back to the math path
    (e.g. value and query head dims differ, or dropout on CPU), the dispatch level sees two full (L, S)
    bmm's forward and four backward. Here the call's counted FLOPs are compared with the honest forward
    count and the difference is removed; its backward (exactly twice the forward's matmuls on either
    path) is corrected by twice that, from a hook on the output's gradient, inside backward's region."""

    def __init__(self, counts: FlopCount) -> None:
        super().__init__()
        self._counts = counts

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        mode = self._counts._active
        before = sum(mode.flop_counts[GLOBAL].values()) if mode is not None else 0
        out = func(*args, **kwargs)
        if mode is None:
            return out
        counted = sum(mode.flop_counts[GLOBAL].values()) - before
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        a = {**dict(zip(names, args, strict=False)), **kwargs}
        query, key, value = a["query"], a["key"], a["value"]
        honest = kept_pairs(query, key, is_causal=bool(a.get("is_causal", False)), mask=a.get("attn_mask"))
        honest *= 2 * (query.shape[-1] + value.shape[-1])
        delta = honest - counted
        self._counts._adjust(delta, modules=True)
        if delta and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self._counts._adjust(2 * delta, modules=False))
        return out
