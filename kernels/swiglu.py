"""SwiGLU: `y = silu(gate) * up`, forward and backward (the gated MLP of Llama-style blocks).

For users' model code, as `swiglu(gate, up)` with the two halves of the up-projection; nothing in
deepfleet calls it yet. The pure-torch functions here are the specification and the CPU path;
`deepfleet::swiglu` is the custom op that dispatches to them or to `kernels/_triton/glu.py` (see
`_dispatch`).

Precision: math in fp32 (float64 stays float64), outputs in the input dtype. Shapes: gate, up, y (...).
Backward: dgate = dy * up * s * (1 + gate * (1 - s)) with s = sigmoid(gate); dup = dy * silu(gate).
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepfleet.kernels._dispatch import triton_module, use_triton


def _acc(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def swiglu_reference(gate: Tensor, up: Tensor) -> Tensor:
    """The specification: differentiable pure torch, fp32 math, output in gate.dtype."""
    return (torch.nn.functional.silu(_acc(gate)) * _acc(up)).to(gate.dtype)


def swiglu_backward_reference(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """(dgate, dup) by the closed form in the module docstring."""
    g, u, d = _acc(gate), _acc(up), _acc(dy)
    s = torch.sigmoid(g)
    return (d * u * s * (1 + g * (1 - s))).to(gate.dtype), (d * g * s).to(up.dtype)


@torch.library.custom_op("deepfleet::swiglu", mutates_args=())
def swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
    if use_triton(gate, up):
        return triton_module("glu").glu_forward(gate, up, "silu")
    return swiglu_reference(gate, up)


@swiglu_op.register_fake
def _(gate: Tensor, up: Tensor) -> Tensor:
    return torch.empty_like(gate)


@torch.library.custom_op("deepfleet::swiglu_backward", mutates_args=())
def swiglu_backward_op(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    if use_triton(dy, gate, up):
        return triton_module("glu").glu_backward(dy, gate, up, "silu")
    return swiglu_backward_reference(dy, gate, up)


@swiglu_backward_op.register_fake
def _(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(gate), torch.empty_like(up)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor]:
    gate, up = ctx.saved_tensors
    return swiglu_backward_op(dy, gate, up)


swiglu_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, differentiable; gate and up must have the same shape and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"swiglu: gate {tuple(gate.shape)}/{gate.dtype} and up {tuple(up.shape)}/{up.dtype} must match"
        )
    return swiglu_op(gate, up)
