"""SwiGLU and GeGLU: references against gradcheck and their closed-form backward, Triton (interpreted)
against the references over odd shapes and dtypes, and the custom ops' registrations."""

from __future__ import annotations

import pytest
import torch

from deepfleet.kernels._dispatch import force_impl
from deepfleet.kernels.geglu import (
    geglu,
    geglu_backward_op,
    geglu_backward_reference,
    geglu_op,
    geglu_reference,
)
from deepfleet.kernels.swiglu import (
    swiglu,
    swiglu_backward_op,
    swiglu_backward_reference,
    swiglu_op,
    swiglu_reference,
)
from tests.kernels.tolerance import assert_close

SHAPES = [(1, 1), (3, 17), (9, 41, 341)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
VARIANTS = {  # name -> (public fn, reference, backward reference, extra args)
    "swiglu": (swiglu, swiglu_reference, swiglu_backward_reference, ()),
    "geglu": (geglu, geglu_reference, geglu_backward_reference, ("none",)),
    "geglu_tanh": (geglu, geglu_reference, geglu_backward_reference, ("tanh",)),
}


def test_references_match_naive_formulas_in_float64() -> None:
    g, u = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 5, dtype=torch.float64)
    torch.testing.assert_close(swiglu_reference(g, u), g / (1 + torch.exp(-g)) * u)
    torch.testing.assert_close(geglu_reference(g, u), 0.5 * g * (1 + torch.erf(g / 2**0.5)) * u)
    k = (2 / torch.pi) ** 0.5
    torch.testing.assert_close(geglu_reference(g, u, "tanh"), 0.5 * g * (1 + torch.tanh(k * (g + 0.044715 * g**3))) * u)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_reference_gradcheck_and_backward_formula(variant: str) -> None:
    _, ref, bwd, extra = VARIANTS[variant]
    g = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    u = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: ref(a, b, *extra), (g, u))
    dy = torch.randn(4, 6, dtype=torch.float64)
    expected = torch.autograd.grad(ref(g, u, *extra), (g, u), dy)
    for got, want in zip(bwd(dy, g, u, *extra), expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_triton_matches_reference(variant: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    fn, ref, _, extra = VARIANTS[variant]
    g = (2 * torch.randn(shape)).to(dtype).requires_grad_()
    u = torch.randn(shape).to(dtype).requires_grad_()
    dy = torch.randn(shape).to(dtype)
    y_ref = ref(g, u, *extra)
    dg_ref, du_ref = torch.autograd.grad(y_ref, (g, u), dy)
    with force_impl("triton"):
        y = fn(g, u, *extra)
        dg, du = torch.autograd.grad(y, (g, u), dy)
    assert_close(f"{variant}.fwd", y, y_ref)
    assert_close(f"{variant}.dgate", dg, dg_ref, scale=2.0)
    assert_close(f"{variant}.dup", du, du_ref)


def test_opcheck(opcheck) -> None:
    g, u = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    opcheck(swiglu_op, (g, u))
    opcheck(geglu_op, (g, u, "tanh"))
    dy = torch.randn(3, 8)
    opcheck(swiglu_backward_op, (dy, g.detach(), u.detach()))
    opcheck(geglu_backward_op, (dy, g.detach(), u.detach(), "none"))


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="approximate"):
        geglu(torch.randn(2), torch.randn(2), "sigmoid")
    with pytest.raises(ValueError, match="must match"):
        swiglu(torch.randn(2, 3), torch.randn(3, 2))
