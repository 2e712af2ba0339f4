"""LayerNorm: the reference against torch's layer_norm and gradcheck, Triton (interpreted) against the
reference over odd shapes and dtypes, with and without bias, and the custom op's registrations."""

from __future__ import annotations

import pytest
import torch

from deepfleet.kernels._dispatch import force_impl
from deepfleet.kernels.layer_norm import (
    layer_norm,
    layer_norm_backward_op,
    layer_norm_backward_reference,
    layer_norm_forward_reference,
    layer_norm_op,
    layer_norm_reference,
)
from tests.kernels.tolerance import assert_close

SHAPES = [(1, 1), (3, 17), (9, 41, 341), (2, 128)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_reference_matches_torch_layer_norm_in_float64() -> None:
    x = torch.randn(5, 33, dtype=torch.float64)
    w, b = torch.randn(33, dtype=torch.float64), torch.randn(33, dtype=torch.float64)
    expected = torch.nn.functional.layer_norm(x, (33,), w, b, eps=1e-5)
    torch.testing.assert_close(layer_norm_reference(x, w, b, 1e-5), expected)


def test_reference_gradcheck_and_backward_formula() -> None:
    x = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: layer_norm_reference(*a, 1e-5), (x, w, b))
    dy = torch.randn(4, 7, dtype=torch.float64)
    expected = torch.autograd.grad(layer_norm_reference(x, w, b, 1e-5), (x, w, b), dy)
    _, mean, rstd = layer_norm_forward_reference(x, w, b, 1e-5)
    for got, want in zip(layer_norm_backward_reference(dy, x, w, mean, rstd), expected, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_reference(shape: tuple[int, ...], dtype: torch.dtype, has_bias: bool) -> None:
    n = shape[-1]
    x = torch.randn(shape).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(n)).to(dtype).requires_grad_()
    b = torch.randn(n).to(dtype).requires_grad_() if has_bias else None
    inputs = (x, w, b) if has_bias else (x, w)
    dy = torch.randn(shape).to(dtype)
    y_ref = layer_norm_reference(x, w, b, 1e-5)
    grads_ref = torch.autograd.grad(y_ref, inputs, dy)
    with force_impl("triton"):
        y = layer_norm(x, w, b, 1e-5)
        grads = torch.autograd.grad(y, inputs, dy)
    assert_close("layer_norm.fwd", y, y_ref)
    assert_close("layer_norm.dx", grads[0], grads_ref[0], scale=2.0)
    assert_close("layer_norm.dw", grads[1], grads_ref[1], scale=4.0)  # sums over rows
    if has_bias:
        assert_close("layer_norm.db", grads[2], grads_ref[2], scale=4.0)


def test_opcheck(opcheck) -> None:
    x = torch.randn(3, 8, requires_grad=True)
    w, b = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    opcheck(layer_norm_op, (x, w, b, 1e-5))
    opcheck(layer_norm_op, (x, w, None, 1e-5))
    _, mean, rstd = layer_norm_forward_reference(x.detach(), w.detach(), None, 1e-5)
    opcheck(layer_norm_backward_op, (torch.randn(3, 8), x.detach(), w.detach(), mean, rstd))


def test_rejects_mismatched_bias() -> None:
    with pytest.raises(ValueError, match="bias shape"):
        layer_norm(torch.randn(2, 4), torch.randn(4), torch.randn(3))
