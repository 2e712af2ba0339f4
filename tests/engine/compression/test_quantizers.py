"""Fake quantization, integer codes and the bits schedule against their reference formulas."""

from __future__ import annotations

import pytest
import torch

from deepfleet.engine.compression.quantizers import (
    fake_quantize,
    last_switch,
    pack_int4,
    quantize_codes,
    scheduled_bits,
    unpack_int4,
)


def ref_symmetric(x: torch.Tensor, bits: int, groups: int) -> torch.Tensor:
    out = []
    for g in x.reshape(groups, -1):
        s = 2 * g.abs().max() / 2**bits
        out.append(torch.clamp(torch.round(g / s), -(2 ** (bits - 1)), 2 ** (bits - 1) - 1) * s)
    return torch.stack(out).reshape(x.shape)


def ref_asymmetric(x: torch.Tensor, bits: int, groups: int) -> torch.Tensor:
    out = []
    for g in x.reshape(groups, -1):
        s = (g.max() - g.min()) / 2**bits
        z = torch.round(g.min() / s) * s
        out.append(torch.clamp(torch.round((g - z) / s), 0, 2**bits - 1) * s + z)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("groups", [1, 3, 6])
def test_symmetric_and_asymmetric_grids_equal_the_formulas(bits: int, groups: int) -> None:
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(bits * groups))
    torch.testing.assert_close(fake_quantize(x, bits, groups=groups), ref_symmetric(x, bits, groups), rtol=0, atol=1e-6)
    torch.testing.assert_close(fake_quantize(x, bits, groups=groups, symmetric=False),
                               ref_asymmetric(x, bits, groups), rtol=0, atol=1e-6)
    # at most 2^bits distinct values per group
    for g in fake_quantize(x, bits, groups=groups).reshape(groups, -1):
        assert g.unique().numel() <= 2**bits


def test_gradient_is_straight_through() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    (fake_quantize(x, 4, groups=2) * torch.arange(32.0).reshape(4, 8)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(32.0).reshape(4, 8))


def test_zero_group_stays_zero_and_static_range_is_used() -> None:
    assert fake_quantize(torch.zeros(2, 4), 8, groups=2).abs().sum() == 0
    x = torch.tensor([-1.0, 0.5, 3.0])
    lo, hi = torch.tensor(-1.0), torch.tensor(1.0)
    s = 2 * 1.0 / 256
    expected = torch.clamp(torch.round(x / s), -128, 127) * s  # 3.0 clips at the static range
    torch.testing.assert_close(fake_quantize(x, 8, min_max=(lo, hi)), expected)


def test_codes_reconstruct_the_fake_quantized_values() -> None:
    x = torch.randn(4, 6)
    codes, scale, zero = quantize_codes(x, 4, groups=4, symmetric=False)
    assert codes.min() >= 0 and codes.max() <= 15
    torch.testing.assert_close((codes * scale + zero).reshape(x.shape), fake_quantize(x, 4, groups=4, symmetric=False))


def test_int4_packing_round_trips() -> None:
    codes = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (3, 4) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)


def test_bits_schedule_drops_one_bit_per_doubling_period() -> None:
    # MoQ: start 8, target 4, period 10 -> drops at 10, 20, 40, 80
    bits = [scheduled_bits(s, start_bits=8, target_bits=4, period=10) for s in (0, 9, 10, 19, 20, 39, 40, 79, 80, 10**6)]
    assert bits == [8, 8, 7, 7, 6, 6, 5, 5, 4, 4]
    assert [last_switch(s, start_bits=8, target_bits=4, period=10) for s in (5, 15, 25, 45, 100)] == [0, 10, 20, 40, 80]
    assert scheduled_bits(0, start_bits=8, target_bits=8, period=0) == 8
    assert scheduled_bits(0, start_bits=8, target_bits=4, period=0) == 4
