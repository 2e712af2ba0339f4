"""Triton gated linear units (SwiGLU, GeGLU) forward and backward; the specifications are
`kernels/swiglu.py` and `kernels/geglu.py`.

Called only through `deepfleet::swiglu[_backward]` / `deepfleet::geglu[_backward]` when the Triton path
is selected. One elementwise kernel per direction; the activation is a compile-time constant. The
backward kernel recomputes act(gate) instead of saving it (one read of gate beats a stored tensor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepfleet.kernels._triton.launch import elementwise_block

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
# globals read inside @triton.jit must be compile-time constants
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
SQRT_HALF = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _act_and_grad(x, ACT: tl.constexpr):
    """(act(x), act'(x)) in fp32."""
    if ACT == 0:
        s = tl.sigmoid(x)
        return x * s, s * (1.0 + x * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(x * SQRT_HALF))
        return x * cdf, cdf + x * INV_SQRT_2PI * tl.exp(-0.5 * x * x)
    else:
        inner = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh(inner)
        dinner = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
        return 0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner


@triton.jit
def _glu_fwd(gate_ptr, up_ptr, y_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act, _ = _act_and_grad(gate, ACT)
    tl.store(y_ptr + offs, (act * up).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _glu_bwd(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act, dact = _act_and_grad(gate, ACT)
    tl.store(dgate_ptr + offs, (dy * up * dact).to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offs, (dy * act).to(dup_ptr.dtype.element_ty), mask=mask)


def glu_forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n, block = gate.numel(), elementwise_block(gate.device)
    if n:
        _glu_fwd[(triton.cdiv(n, block),)](gate, up, y, n, ACT=ACTIVATIONS[activation], BLOCK=block)
    return y


def glu_backward(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    dy, gate, up = dy.contiguous(), gate.contiguous(), up.contiguous()
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n, block = gate.numel(), elementwise_block(gate.device)
    if n:
        _glu_bwd[(triton.cdiv(n, block),)](dy, gate, up, dgate, dup, n, ACT=ACTIVATIONS[activation], BLOCK=block)
    return dgate, dup
