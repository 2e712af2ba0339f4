"""RoPE: the reference against a complex-number rotation and gradcheck, inverse = backward, Triton
(interpreted) against the reference over odd shapes and dtypes, and the custom op's registrations."""

from __future__ import annotations

import pytest
import torch

from deepfleet.kernels._dispatch import force_impl
from deepfleet.kernels.rope import rope, rope_cos_sin, rope_op, rope_reference
from tests.kernels.tolerance import assert_close

SHAPES = [(1, 1, 1, 2), (3, 17, 1, 6), (2, 9, 5, 64), (1, 41, 3, 34)]  # (batch, seq, heads, head_dim)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_reference_matches_complex_rotation_in_float64() -> None:
    x = torch.randn(2, 7, 3, 8, dtype=torch.float64)
    cos, sin = rope_cos_sin(7, 8)
    angle = torch.atan2(sin.double(), cos.double())  # (seq, half)
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    expected = torch.cat([z.real, z.imag], dim=-1)
    torch.testing.assert_close(rope_reference(x, cos.double(), sin.double()), expected)


def test_reference_gradcheck_and_inverse_is_backward() -> None:
    x = torch.randn(2, 5, 2, 6, dtype=torch.float64, requires_grad=True)
    cos, sin = (t.double() for t in rope_cos_sin(5, 6, base=100.0))
    assert torch.autograd.gradcheck(lambda a: rope_reference(a, cos, sin), (x,))
    dy = torch.randn_like(x)
    (dx,) = torch.autograd.grad(rope_reference(x, cos, sin), x, dy)
    torch.testing.assert_close(rope_reference(dy, cos, sin, inverse=True), dx)
    torch.testing.assert_close(rope_reference(rope_reference(x, cos, sin), cos, sin, inverse=True), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape).to(dtype).requires_grad_()
    cos, sin = rope_cos_sin(shape[1], shape[-1])
    dy = torch.randn(shape).to(dtype)
    y_ref = rope_reference(x, cos, sin)
    (dx_ref,) = torch.autograd.grad(y_ref, x, dy)
    with force_impl("triton"):
        y = rope(x, cos, sin)
        (dx,) = torch.autograd.grad(y, x, dy)
    assert_close("rope.fwd", y, y_ref)
    assert_close("rope.dx", dx, dx_ref)


def test_opcheck(opcheck) -> None:
    x = torch.randn(2, 3, 2, 4, requires_grad=True)
    cos, sin = rope_cos_sin(3, 4)
    opcheck(rope_op, (x, cos, sin, False))
    opcheck(rope_op, (x, cos, sin, True))


def test_rejects_bad_shapes() -> None:
    cos, sin = rope_cos_sin(3, 4)
    with pytest.raises(ValueError, match="head_dim even"):
        rope(torch.randn(1, 3, 2, 5), cos, sin)
    with pytest.raises(ValueError, match="cos shape"):
        rope(torch.randn(1, 4, 2, 4), cos, sin)
