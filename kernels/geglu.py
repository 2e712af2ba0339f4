"""GeGLU: `y = gelu(gate) * up`, forward and backward, exact (erf) or tanh-approximated GELU.

For users' model code, as `geglu(gate, up, approximate="none"|"tanh")`; nothing in deepfleet calls it
yet. The pure-torch functions here are the specification and the CPU path; `deepfleet::geglu` is the
custom op that dispatches to them or to `kernels/_triton/glu.py` (see `_dispatch`).

Precision: math in fp32 (float64 stays float64), outputs in the input dtype. Shapes: gate, up, y (...).
Backward: dgate = dy * up * gelu'(gate), dup = dy * gelu(gate), with
  exact: gelu'(x) = Phi(x) + x * phi(x);
  tanh:  gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2),
         t = tanh(sqrt(2/pi) (x + 0.044715 x^3)).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from deepfleet.kernels._dispatch import triton_module, use_triton

APPROXIMATIONS = {"none": "gelu", "tanh": "gelu_tanh"}


def _acc(t: Tensor) -> Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def geglu_reference(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """The specification: differentiable pure torch, fp32 math, output in gate.dtype."""
    return (torch.nn.functional.gelu(_acc(gate), approximate=approximate) * _acc(up)).to(gate.dtype)


def geglu_backward_reference(dy: Tensor, gate: Tensor, up: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """(dgate, dup) by the closed forms in the module docstring."""
    x, u, d = _acc(gate), _acc(up), _acc(dy)
    if approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        t = torch.tanh(k * (x + 0.044715 * x**3))
        act = 0.5 * x * (1 + t)
        dact = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)
    else:
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        act = x * cdf
        dact = cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return (d * u * dact).to(gate.dtype), (d * act).to(up.dtype)


@torch.library.custom_op("deepfleet::geglu", mutates_args=())
def geglu_op(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    if use_triton(gate, up):
        return triton_module("glu").glu_forward(gate, up, APPROXIMATIONS[approximate])
    return geglu_reference(gate, up, approximate)


@geglu_op.register_fake
def _(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    return torch.empty_like(gate)


@torch.library.custom_op("deepfleet::geglu_backward", mutates_args=())
def geglu_backward_op(dy: Tensor, gate: Tensor, up: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    if use_triton(dy, gate, up):
        return triton_module("glu").glu_backward(dy, gate, up, APPROXIMATIONS[approximate])
    return geglu_backward_reference(dy, gate, up, approximate)


@geglu_backward_op.register_fake
def _(dy: Tensor, gate: Tensor, up: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    return torch.empty_like(gate), torch.empty_like(up)


def _setup_context(ctx, inputs, output) -> None:
    gate, up, ctx.approximate = inputs
    ctx.save_for_backward(gate, up)


def _backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor, None]:
    gate, up = ctx.saved_tensors
    dgate, dup = geglu_backward_op(dy, gate, up, ctx.approximate)
    return dgate, dup, None


geglu_op.register_autograd(_backward, setup_context=_setup_context)


def geglu(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """gelu(gate) * up, differentiable; approximate is "none" (erf) or "tanh"."""
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"geglu: approximate={approximate!r}; use one of {', '.join(APPROXIMATIONS)}")
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"geglu: gate {tuple(gate.shape)}/{gate.dtype} and up {tuple(up.shape)}/{up.dtype} must match"
        )
    return geglu_op(gate, up, approximate)
