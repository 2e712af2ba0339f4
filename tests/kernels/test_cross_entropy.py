"""Cross-entropy: the reference against torch's cross_entropy and gradcheck, the chunked forward's
gradient against autograd, Triton (interpreted) against the reference over odd shapes, vocab 50257,
dtypes, ignore_index, label smoothing and reductions, and the custom op's registrations."""

from __future__ import annotations

import pytest
import torch

from deepfleet.kernels import cross_entropy as ce_module
from deepfleet.kernels._dispatch import force_impl
from deepfleet.kernels.cross_entropy import (
    cross_entropy,
    cross_entropy_backward_op,
    cross_entropy_forward_reference,
    cross_entropy_op,
    cross_entropy_reference,
)
from tests.kernels.tolerance import assert_close

SHAPES = [(1, 1), (3, 17), (9, 341), (2, 50257)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _targets(rows: int, vocab: int, *, ignore_every: int = 3) -> torch.Tensor:
    t = torch.randint(0, vocab, (rows,))
    t[1::ignore_every] = -100  # some ignored rows whenever there are two or more
    return t


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_reference_matches_torch_in_float64(reduction: str, smoothing: float) -> None:
    x = torch.randn(7, 29, dtype=torch.float64)
    t = _targets(7, 29)
    expected = torch.nn.functional.cross_entropy(x, t, reduction=reduction, label_smoothing=smoothing)
    got = cross_entropy_reference(x, t, reduction=reduction, label_smoothing=smoothing)
    torch.testing.assert_close(got, expected)


def test_reference_gradcheck_and_chunked_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    t = _targets(6, 11)
    assert torch.autograd.gradcheck(lambda a: cross_entropy_reference(a, t, label_smoothing=0.1, reduction="none"), (x,))
    monkeypatch.setattr(ce_module, "REFERENCE_CHUNK_ROWS", 4)  # several chunks, one partial
    losses, row_grad = cross_entropy_forward_reference(x.detach(), t, -100, 0.1, True)
    expected = cross_entropy_reference(x, t, label_smoothing=0.1, reduction="none")
    torch.testing.assert_close(losses, expected.detach())
    for i in range(6):  # each row's gradient is the gradient of that row's loss alone
        (g,) = torch.autograd.grad(expected[i], x, retain_graph=True)
        torch.testing.assert_close(row_grad[i], g[i])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_matches_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    rows, vocab = shape
    x = (3 * torch.randn(shape)).to(dtype).requires_grad_()
    t = _targets(rows, vocab)
    for smoothing, reduction in ((0.0, "mean"), (0.1, "none")):
        ref = cross_entropy_reference(x, t, label_smoothing=smoothing, reduction=reduction)
        upstream = torch.rand_like(ref) if reduction == "none" else torch.tensor(1.5)
        (dx_ref,) = torch.autograd.grad(ref, x, upstream)
        with force_impl("triton"):
            got = cross_entropy(x, t, label_smoothing=smoothing, reduction=reduction)
            (dx,) = torch.autograd.grad(got, x, upstream)
        if reduction == "mean" and not (t != -100).any():
            assert got.isnan() and ref.isnan()
        else:
            assert_close(f"cross_entropy.loss({dtype})".replace("torch.", ""), got, ref, scale=5.0)
        assert_close("cross_entropy.dlogits", dx, dx_ref, scale=2.0)  # rounded twice: row grad, then scaled


def test_sum_reduction_and_no_grad_path() -> None:
    x, t = torch.randn(5, 40), _targets(5, 40)
    with force_impl("triton"):
        got = cross_entropy(x, t, reduction="sum", label_smoothing=0.3)
    torch.testing.assert_close(got, cross_entropy_reference(x, t, reduction="sum", label_smoothing=0.3))


def test_opcheck(opcheck) -> None:
    x = torch.randn(4, 19, requires_grad=True)
    t = _targets(4, 19)
    opcheck(cross_entropy_op, (x, t, -100, 0.1, True))
    opcheck(cross_entropy_op, (x.detach(), t, -100, 0.0, False))
    opcheck(cross_entropy_backward_op, (torch.randn(4, 19), torch.rand(4)))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"reduction": "avg"}, "reduction"), ({"label_smoothing": 1.5}, "label_smoothing")],
)
def test_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), **kwargs)
