"""RMSNorm: the reference against an independent formula and gradcheck, Triton (interpreted) against the
reference over odd shapes and dtypes, and the custom op's registrations (opcheck)."""

from __future__ import annotations

import pytest
import torch

from deepfleet.kernels._dispatch import force_impl
from deepfleet.kernels.rms_norm import (
    rms_norm,
    rms_norm_backward_op,
    rms_norm_backward_reference,
    rms_norm_forward_reference,
    rms_norm_op,
    rms_norm_reference,
)
from tests.kernels.tolerance import assert_close

SHAPES = [(1, 1), (3, 17), (9, 41, 341), (2, 128)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_reference_matches_torch_rms_norm_in_float64() -> None:
    x, w = torch.randn(5, 33, dtype=torch.float64), torch.randn(33, dtype=torch.float64)
    expected = torch.nn.functional.rms_norm(x, (33,), w, eps=1e-6)
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-6), expected)


def test_reference_gradcheck_and_backward_formula() -> None:
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm_reference(a, b, 1e-5), (x, w))
    dy = torch.randn(4, 7, dtype=torch.float64)
    dx, dw = torch.autograd.grad(rms_norm_reference(x, w, 1e-5), (x, w), dy)
    _, rstd = rms_norm_forward_reference(x, w, 1e-5)
    bx, bw = rms_norm_backward_reference(dy, x, w, rstd)
    torch.testing.assert_close(bx, dx)
    torch.testing.assert_close(bw, dw)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    n = shape[-1]
    x = torch.randn(shape).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(n)).to(dtype).requires_grad_()
    dy = torch.randn(shape).to(dtype)
    y_ref = rms_norm_reference(x, w, 1e-6)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    with force_impl("triton"):
        y = rms_norm(x, w, 1e-6)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert_close("rms_norm.fwd", y, y_ref)
    assert_close("rms_norm.dx", dx, dx_ref)
    assert_close("rms_norm.dw", dw, dw_ref, scale=4.0)  # a sum over rows


def test_opcheck(opcheck) -> None:
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    opcheck(rms_norm_op, (x, w, 1e-6))
    _, rstd = rms_norm_forward_reference(x.detach(), w.detach(), 1e-6)
    opcheck(rms_norm_backward_op, (torch.randn(3, 8), x.detach(), w.detach(), rstd))


def test_rejects_mismatched_weight() -> None:
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(torch.randn(2, 4), torch.randn(5))
