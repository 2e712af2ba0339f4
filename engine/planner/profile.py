"""What the planner knows about a model before anything is launched: its parameters (counted on the
meta device, nothing allocated), its blocks (`engine/blocks.py`) and the activation bytes one
forward/backward holds, per sample and per block.

Caller: `engine/planner/estimate.py` (`plan`), and through it `deepfleet plan` and the autotuner.

Activations are measured, not modelled: a forward and backward at micro-batch 1 and 2 on the CPU runs
under `engine/memory.py`'s `LiveStorages` (every storage an op makes, freed when its last reference
dies), with the parameters' gradients allocated beforehand so only activations, their gradients and
temporaries count. Two batch sizes give bytes = fixed + per_sample * batch, which holds for the
transformer family (every activation is batch-major). Forward hooks on each block record what the
block leaves alive (what checkpointing it would free) and what it returns (what a checkpointed block
keeps). A formula for attention (flash vs math kernels, fused or not) would be wrong by the kernel
choice; measuring the real kernels on this process's torch is the accurate way, and costs one tiny
step. `probe_device="meta"` runs the same probe on meta tensors (no data at all, for models too large
to materialize here), where a few kernels save a little more than their CPU twins.
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deepfleet.engine.blocks import blocks
from deepfleet.engine.memory import LiveStorages


@dataclass(frozen=True)
class Linear:
    """bytes = fixed + per_sample * micro_batch."""

    fixed: float
    per_sample: float

    def at(self, micro_batch: int) -> float:
        return self.fixed + self.per_sample * micro_batch

    @staticmethod
    def fit(at_1: float, at_2: float) -> Linear:
        return Linear(fixed=max(0.0, 2 * at_1 - at_2), per_sample=max(0.0, at_2 - at_1))


@dataclass(frozen=True)
class BlockProfile:
    """One block: its parameter count, the bytes its forward leaves alive for backward (`saved`,
    including its output) and the bytes of its output (what the next block, or a checkpoint, keeps)."""

    params: int
    saved: Linear
    output: Linear

    def freed_by_checkpoint(self, micro_batch: int) -> float:
        return max(0.0, self.saved.at(micro_batch) - self.output.at(micro_batch))


@dataclass(frozen=True)
class ModelProfile:
    """The model as the planner sees it (bytes in the probe's dtype, fp32 unless the model is not)."""

    num_params: int
    trainable_params: int
    param_bytes: int
    """Bytes of the parameters as the model is built (4 per fp32 parameter)."""
    blocks: tuple[BlockProfile, ...]
    activation_peak: Linear
    """High-water mark of activations, their gradients and temporaries over forward + backward,
    without checkpointing (parameters and their gradients excluded)."""
    recompute_overhead: Linear = Linear(0.0, 0.0)
    """What a checkpointed run holds beyond "plain minus what each block's checkpoint frees": the
    recomputed block's activations and its backward's working set, measured with every block
    checkpointed (torch's non-reentrant checkpoint)."""
    probe_device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def largest_block_params(self) -> int:
        return max((b.params for b in self.blocks), default=self.num_params)

    @property
    def hidden_size(self) -> int | None:
        return self.extra.get("hidden_size")


def resolve_factory(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """"pkg.mod:function" (the job spec's `entrypoint.factory` form) or a callable -> the callable.

    Raises ValueError naming the fix when the module or attribute is missing."""
    if callable(spec):
        return spec
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model: expected 'package.module:function', got {spec!r}; name a factory function")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"--model: cannot import {module_name!r} ({e}); put its package on PYTHONPATH or run "
                         "from the directory that holds it") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--model: {module_name!r} has no {attr!r}; name a function defined in that module")
        obj = getattr(obj, part)
    return obj


@dataclass
class Built:
    """What a factory gave: the model, a sample (one item of its data set, or a batch maker) and its loss."""

    model: nn.Module
    sample: Any = None
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    training_data: Any = None


def build(factory: Callable[..., Any], kwargs: Mapping[str, Any] | None = None, *, device: str = "meta") -> Built:
    """Call `factory(**kwargs)` with `device` as the default device (meta: nothing is allocated). It may
    return an `nn.Module`, or an object or mapping with `model` and optionally `training_data`,
    `loss_fn`, `collate_fn` (the managed loop's `ManagedJob`)."""
    with torch.device(device):
        out = factory(**dict(kwargs or {}))
    if isinstance(out, nn.Module):
        return Built(model=out)
    get = out.get if isinstance(out, Mapping) else (lambda k, d=None: getattr(out, k, d))
    model = get("model")
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model: the factory returned {type(out).__name__} without an nn.Module `model`; "
                         "return a module or an object with `model` (and `training_data`)")
    data = get("training_data")
    sample = data[0] if data is not None and len(data) else None
    return Built(model=model, sample=sample, loss_fn=get("loss_fn"), collate_fn=get("collate_fn"),
                 training_data=data)


def _on_cpu(x: Any) -> Any:
    """A sample with every meta tensor replaced by zeros on the CPU (its values do not change memory)."""
    if isinstance(x, torch.Tensor):
        return torch.zeros(x.shape, dtype=x.dtype) if x.is_meta else x
    if isinstance(x, Mapping):
        return {k: _on_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_on_cpu(v) for v in x)
    return x


def _batch(built: Built, n: int, device: str) -> Any:
    if built.sample is None:
        raise ValueError("--model: the factory gave no training_data to take a sample batch from; return an "
                         "object with `model` and `training_data`")
    sample = _on_cpu(built.sample)
    rows = [sample] * n
    batch = built.collate_fn(rows) if built.collate_fn else torch.utils.data.default_collate(rows)
    if device == "meta":
        return _to_meta(batch)
    return batch


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, Mapping):
        return {k: _to_meta(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    return x


def _loss(built: Built, model: nn.Module, batch: Any) -> torch.Tensor:
    out = model(batch)
    return built.loss_fn(out, batch) if built.loss_fn else out


def _measure(built: Built, model: nn.Module, n: int, device: str) -> tuple[float, list[tuple[float, float]]]:
    """(peak bytes over forward+backward, [(saved, output) per block]) at micro-batch `n`."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)  # accumulated into in place: gradients are not activations
    batch = _batch(built, n, device)
    per_block: list[list[float]] = []
    handles = []
    live = LiveStorages()

    def pre(_m: nn.Module, _args: Any) -> None:
        per_block.append([live.current, 0.0, 0.0])

    def post(_m: nn.Module, _args: Any, out: Any) -> None:
        rec = per_block[-1]
        rec[1] = live.current - rec[0]
        first = out[0] if isinstance(out, (tuple, list)) else out
        rec[2] = float(first.untyped_storage().nbytes()) if isinstance(first, torch.Tensor) else 0.0

    for block in blocks(model):
        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    try:
        with live:
            live.track(model.parameters())
            live.track(p.grad for p in model.parameters() if p.grad is not None)
            live.track(b for b in model.buffers())
            base = live.current
            _loss(built, model, batch).backward()
    finally:
        for h in handles:
            h.remove()
    return live.peak - base, [(saved, out) for _, saved, out in per_block]


def _checkpoint_every_block(model: nn.Module) -> None:
    """Wrap each of `blocks(model)` in place in torch's non-reentrant checkpoint."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    targets = {id(b) for b in blocks(model)}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in targets:
                setattr(parent, name, checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT))


def profile_model(factory: str | Callable[..., Any], kwargs: Mapping[str, Any] | None = None, *,
                  probe_device: str = "cpu") -> ModelProfile:
    """Count the factory's model's parameters on the meta device and measure its activations (see the
    module docstring). `probe_device`: "cpu" (a real micro-batch-1 and -2 step, the accurate figure) or
    "meta" (no memory at all)."""
    fn = resolve_factory(factory)
    built = build(fn, kwargs, device="meta")
    meta_model = built.model
    params = list(meta_model.parameters())
    num = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    block_params = [sum(p.numel() for p in b.parameters()) for b in blocks(meta_model)]
    if probe_device == "meta":
        model = meta_model
    else:
        model = copy.deepcopy(meta_model).to_empty(device=probe_device)
        for p in model.parameters():
            with torch.no_grad():
                p.normal_(0.0, 0.02)  # finite values; memory does not depend on them
    model.train()
    peak_1, blocks_1 = _measure(built, model, 1, probe_device)
    peak_2, blocks_2 = _measure(built, model, 2, probe_device)
    block_profiles = tuple(
        BlockProfile(params=bp, saved=Linear.fit(a[0], b[0]), output=Linear.fit(a[1], b[1]))
        for bp, a, b in zip(block_params, blocks_1, blocks_2, strict=False)
    )
    overhead = Linear(0.0, 0.0)
    if block_profiles:
        _checkpoint_every_block(model)
        ckpt = [_measure(built, model, n, probe_device)[0] for n in (1, 2)]
        freed = [sum(b.freed_by_checkpoint(n) for b in block_profiles) for n in (1, 2)]
        plain = [peak_1, peak_2]
        overhead = Linear.fit(*(ckpt[i] - (plain[i] - freed[i]) for i in range(2)))
    hidden = getattr(getattr(meta_model, "config", None), "hidden_size", None)
    return ModelProfile(num_params=num, trainable_params=trainable, param_bytes=param_bytes,
                        blocks=block_profiles, activation_peak=Linear.fit(peak_1, peak_2),
                        recompute_overhead=overhead,
                        probe_device=probe_device, extra={"hidden_size": hidden})
