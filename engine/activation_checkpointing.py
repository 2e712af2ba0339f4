"""Activation checkpointing: recompute in backward instead of keeping activations, per call or per block.

Callers: `engine/build.py` (`apply_from_config`, the `deepfleet_activation_checkpointing` section, before
the ZeRO strategy wraps the model) and `engine/compat/checkpointing.py` (`checkpoint_call`, under
DeepSpeed's `deepspeed.checkpointing.checkpoint`). A planner's memory-budget mode hands its own per-block
list to `apply_block_choices`, the seam every mode goes through.

Built on torch, not hand-written: recomputation is `torch.utils.checkpoint`'s non-reentrant variant (it
restores the CPU and device RNG states, so dropout masks replay, and it lets gradients flow to inputs and
parameters as in a plain forward); selective recomputation is
`torch.utils.checkpoint.create_selective_checkpoint_contexts` with a policy that keeps the listed ops'
outputs; block checkpointing is torch's composable `checkpoint(module)` (forward hooks, so parameter
names, state dicts and DeepSpeed checkpoints keep the model's own paths, and it composes with FSDP2's
`fully_shard` when applied before it, which the order in build.py guarantees). Host offload of what a
block keeps is `torch.autograd.graph.save_on_cpu` for blocks that are not recomputed; for a recomputed
block the only thing kept is its inputs, and those are moved to the host outside the checkpoint and back
to the device inside it (two differentiable `.to()` copies that save nothing themselves), because the
checkpoint holds its inputs by reference, not through saved-tensor hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from deepfleet.engine.blocks import blocks

Recompute = Literal["none", "full", "selective"]
DEFAULT_OPS = ("matmul", "attention")

# The op groups `deepfleet_activation_checkpointing.ops` names (config_activation_checkpointing.OP_GROUPS).
_OP_GROUPS: dict[str, tuple[str, ...]] = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm"),
    "attention": ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_fused_attention_overrideable"),
}


@dataclass(frozen=True)
class BlockChoice:
    """What one block does with its activations: `recompute` ("none", "full", "selective") and `offload`
    (what it keeps for backward lives in host memory)."""

    recompute: Recompute = "none"
    offload: bool = False

    @property
    def active(self) -> bool:
        return self.recompute != "none" or self.offload


def resolve_ops(names: Sequence[str], *, key: str = "deepfleet_activation_checkpointing.ops") -> set[Any]:
    """The ATen overload packets `names` mean (op groups and `aten.<op>` names); raises ValueError naming
    `key` for an op this torch does not have."""
    ops: set[Any] = set()
    for name in names:
        for op in _OP_GROUPS.get(name, (name.removeprefix("aten."),)):
            packet = getattr(torch.ops.aten, op.split(".")[0], None)
            if packet is None:
                if name in _OP_GROUPS:
                    continue  # a kernel this build lacks (e.g. cuDNN attention on a CPU build)
                raise ValueError(f"{key}: {name!r} is not an ATen op of this torch; use an op name such as \"aten.mm\"")
            ops.add(packet)
    return ops


def selective_context(ops: set[Any]) -> Callable[[], tuple[AbstractContextManager, AbstractContextManager]]:
    """`context_fn` for torch's checkpoint: keep the outputs of `ops`, recompute every other op."""

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        packet = getattr(func, "overloadpacket", func)
        return CheckpointPolicy.MUST_SAVE if packet in ops else CheckpointPolicy.PREFER_RECOMPUTE

    return lambda: create_selective_checkpoint_contexts(policy)


# --------------------------------------------------------------------------- host copies of inputs


def _is_activation(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def to_host(values: tuple, kwargs: dict) -> tuple[tuple, dict, list[torch.device | None]]:
    """Floating-point tensors of `values`/`kwargs` copied to the host (differentiably; a CPU tensor is
    returned as is), with the devices to bring them back to (None for everything else)."""
    devices = [v.device if _is_activation(v) else None for v in (*values, *kwargs.values())]
    host = tuple(v.to("cpu") if _is_activation(v) else v for v in values)
    return host, {k: v.to("cpu") if _is_activation(v) else v for k, v in kwargs.items()}, devices


def to_devices(values: tuple, kwargs: dict, devices: Sequence[torch.device | None]) -> tuple[tuple, dict]:
    """Undo `to_host`."""
    n = len(values)
    back = tuple(v.to(d) if d is not None else v for v, d in zip(values, devices[:n], strict=True))
    return back, {k: v.to(d) if d is not None else v for (k, v), d in zip(kwargs.items(), devices[n:], strict=True)}


def checkpoint_call(function: Callable[..., Any], *args: Any, offload: bool = False,
                    context_fn: Callable[[], tuple[AbstractContextManager, AbstractContextManager]] | None = None,
                    **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` with its activations recomputed in backward (non-reentrant); with
    `offload`, the inputs the checkpoint keeps stay in host memory until the recomputation."""
    extra = {} if context_fn is None else {"context_fn": context_fn}
    if not offload:
        return checkpoint(function, *args, use_reentrant=False, **extra, **kwargs)
    host_args, host_kwargs, devices = to_host(args, kwargs)

    def on_device(*a: Any, **kw: Any) -> Any:
        a, kw = to_devices(a, kw, devices)
        return function(*a, **kw)

    return checkpoint(on_device, *host_args, use_reentrant=False, **extra, **host_kwargs)


# --------------------------------------------------------------------------- blocks


def choices_from_config(section: Any, n_blocks: int) -> list[BlockChoice]:
    """The per-block choices of a `deepfleet_activation_checkpointing` section over `n_blocks` blocks."""
    recompute: Recompute = {"off": "none", "blocks": "full", "selective": "selective"}[section.mode]
    return [
        BlockChoice(recompute if recompute != "none" and i % section.every == 0 else "none",
                    offload=section.offload)
        for i in range(n_blocks)
    ]


def apply_from_config(model: nn.Module, section: Any) -> list[BlockChoice]:
    """Apply a `deepfleet_activation_checkpointing` section to `blocks(model)`; returns the choices made.
    Raises ValueError naming the section when a mode is asked of a model without blocks."""
    if section.mode == "off" and not section.offload:
        return []
    found = blocks(model)
    if not found:
        raise ValueError(
            "deepfleet_activation_checkpointing.mode: the model has no repeated blocks to checkpoint; name them "
            "with a `deepfleet_blocks` attribute on the model (e.g. \"model.layers\") or set mode \"off\""
        )
    choices = choices_from_config(section, len(found))
    apply_block_choices(found, choices, ops=section.ops)
    return choices


def apply_block_choices(block_modules: Sequence[nn.Module], choices: Sequence[BlockChoice], *,
                        ops: Sequence[str] = DEFAULT_OPS) -> None:
    """Give each block its choice (the seam of every mode: config, planner budget). Must run before the
    ZeRO strategy wraps the model (FSDP2's hooks then run outside the checkpoint's, as torch composes
    them). `ops`: what "selective" keeps. Raises ValueError when the lengths differ."""
    if len(block_modules) != len(choices):
        raise ValueError(f"activation checkpointing: {len(choices)} choices for {len(block_modules)} blocks; "
                         "give one choice per block of blocks(model)")
    kept = resolve_ops(ops) if any(c.recompute == "selective" for c in choices) else set()
    from torch.distributed._composable import checkpoint as checkpoint_module

    for block, choice in zip(block_modules, choices, strict=True):
        if choice.recompute == "none":
            if choice.offload:
                _save_on_host(block)
            continue
        if choice.offload:  # inputs to the host before the checkpoint takes them, back inside it
            block.register_forward_pre_hook(_inputs_to_host, with_kwargs=True)
        extra = {"context_fn": selective_context(kept)} if choice.recompute == "selective" else {}
        checkpoint_module(block, **extra)
        if choice.offload:
            block.register_forward_pre_hook(_inputs_to_device, with_kwargs=True)


_DEVICES = "_deepfleet_ac_input_devices"


def _inputs_to_host(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    from torch.distributed._composable import checkpoint as checkpoint_module

    if not checkpoint_module.state(module).enable_hook:  # the recomputation: its inputs are the host copies
        return args, kwargs
    host_args, host_kwargs, devices = to_host(args, kwargs)
    setattr(module, _DEVICES, devices)
    return host_args, host_kwargs


def _inputs_to_device(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return to_devices(args, kwargs, getattr(module, _DEVICES))


def _save_on_host(block: nn.Module) -> None:
    """Every tensor `block`'s forward saves for backward is kept in host memory (save_on_cpu)."""
    contexts: list[AbstractContextManager] = []

    def enter(module: nn.Module, args: tuple) -> None:
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
        ctx.__enter__()
        contexts.append(ctx)

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        if contexts:
            contexts.pop().__exit__(None, None, None)

    block.register_forward_pre_hook(enter)
    block.register_forward_hook(leave, always_call=True)
