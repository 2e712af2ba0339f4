"""1-bit pack/unpack: the reference against numpy's bit packing and a per-chunk naive formula, the
error-feedback identity, Triton (interpreted) against the reference over odd sizes, chunk sizes and
dtypes, and the custom ops' registrations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepfleet.kernels._dispatch import force_impl
from deepfleet.kernels.onebit_pack import (
    onebit_pack,
    onebit_pack_op,
    onebit_pack_reference,
    onebit_unpack,
    onebit_unpack_op,
    onebit_unpack_reference,
)
from tests.kernels.tolerance import assert_close

CASES = [((1, 1), 8), ((3, 17), 16), ((9, 41, 341), 2048), ((1000,), 24)]  # (shape, chunk_size)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_reference_matches_numpy_packbits_and_naive_scales() -> None:
    x = torch.randn(37, dtype=torch.float32)
    error = 0.1 * torch.randn(37)
    c = (x + error).numpy().copy()
    packed, scales = onebit_pack_reference(x, error, 16)
    expected_bytes = np.packbits(c >= 0, bitorder="little")
    assert packed.numpy().tobytes() == expected_bytes.tobytes()
    naive = [np.abs(c[i : i + 16]).mean() for i in range(0, 37, 16)]
    np.testing.assert_allclose(scales.numpy(), naive, rtol=1e-6)
    values = onebit_unpack_reference(packed, scales, 37, 16, torch.float32)
    np.testing.assert_allclose(values.numpy(), np.where(c >= 0, 1, -1) * np.repeat(naive, 16)[:37], rtol=1e-6)
    torch.testing.assert_close(values + error, torch.from_numpy(c))  # error feedback keeps what was lost


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "chunk_size"), CASES, ids=str)
def test_triton_matches_reference(shape: tuple[int, ...], chunk_size: int, dtype: torch.dtype) -> None:
    x = torch.randn(shape).to(dtype)
    error_ref = 0.05 * torch.randn(x.numel())
    error = error_ref.clone()
    packed_ref, scales_ref = onebit_pack_reference(x, error_ref, chunk_size)
    values_ref = onebit_unpack_reference(packed_ref, scales_ref, x.numel(), chunk_size, dtype)
    with force_impl("triton"):
        packed, scales = onebit_pack(x, error, chunk_size=chunk_size)
        values = onebit_unpack(packed, scales, numel=x.numel(), chunk_size=chunk_size, dtype=dtype)
    assert torch.equal(packed, packed_ref)
    assert_close("onebit_pack.scales", scales, scales_ref)
    assert_close("onebit_pack.error", error, error_ref)
    assert_close("onebit_unpack.values", values, values_ref)


def test_opcheck(opcheck) -> None:
    x, error = torch.randn(45), torch.randn(45)
    opcheck(onebit_pack_op, (x, error, 16))
    packed, scales = onebit_pack_reference(x, error.clone(), 16)
    opcheck(onebit_unpack_op, (packed, scales, 45, 16, torch.bfloat16))


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="chunk_size=12"):
        onebit_pack(torch.randn(4), torch.zeros(4), chunk_size=12)
    with pytest.raises(ValueError, match="error must be"):
        onebit_pack(torch.randn(4), torch.zeros(4, dtype=torch.bfloat16), chunk_size=8)
    with pytest.raises(ValueError, match="packed bytes"):
        onebit_unpack(torch.zeros(2, dtype=torch.uint8), torch.ones(1), numel=30, chunk_size=32)


@pytest.mark.parametrize(("numel", "chunk_size"), [(8, 8), (48, 16), (4096, 2048), (24 * 40, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_torch_path_is_bit_identical_to_the_reference(numel: int, chunk_size: int, dtype: torch.dtype) -> None:
    from deepfleet.kernels.onebit_pack import onebit_pack_blocked, onebit_unpack_blocked

    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g).to(dtype)
    error = torch.randn(numel, generator=g) * 0.1
    ref_error, blocked_error = error.clone(), error.clone()
    packed, scales = onebit_pack_reference(x, ref_error, chunk_size)
    packed_b, scales_b = onebit_pack_blocked(x, blocked_error, chunk_size)
    assert torch.equal(packed, packed_b) and torch.equal(scales, scales_b) and torch.equal(ref_error, blocked_error)
    assert torch.equal(onebit_unpack_blocked(packed, scales, numel, chunk_size, dtype),
                       onebit_unpack_reference(packed, scales, numel, chunk_size, dtype))
