"""Compressed layers: each technique switches on at its configured step and equals its formula."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepfleet.engine.compression import masks as M
from deepfleet.engine.compression.compress import init_compression
from deepfleet.engine.compression.layers import CompressedLinear
from deepfleet.engine.compression.quantizers import fake_quantize
from deepfleet.engine.compression.scheduler import CompressionScheduler


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _section(technique: str, shared: dict, params: dict, modules: list[str]) -> dict:
    return {"compression_training": {technique: {
        "shared_parameters": {"enabled": True, **shared},
        "different_groups": {"g": {"params": params, "modules": modules}}}}}


def test_layers_are_swapped_keeping_the_parameters() -> None:
    m = Two()
    weight = m.a.weight
    init_compression(m, _section("sparse_pruning", {"schedule_offset": 0}, {"dense_ratio": 0.5}, ["a"]))
    assert isinstance(m.a, CompressedLinear) and m.a.weight is weight and not isinstance(m.b, CompressedLinear)
    init_compression(m, _section("sparse_pruning", {"schedule_offset": 0}, {"dense_ratio": 0.5}, ["a"]))  # no-op


def test_weight_bits_follow_the_schedule_from_the_offset() -> None:
    m = init_compression(Two(), _section(
        "weight_quantization", {"schedule_offset": 3, "quantize_groups": 4},
        {"start_bits": 8, "target_bits": 6, "quantization_period": 2}, ["a"]))
    sched = CompressionScheduler(m)
    x = torch.randn(5, 8)
    expected_bits = {0: None, 2: None, 3: 8, 4: 8, 5: 7, 6: 7, 7: 6, 20: 6}  # drops at offset+2, offset+4
    for step, bits in expected_bits.items():
        sched.step(step)
        w = m.a.weight if bits is None else fake_quantize(m.a.weight, bits, groups=4)
        torch.testing.assert_close(m.a(x), F.linear(x, w, m.a.bias), rtol=0, atol=1e-6)


def test_quantize_weight_in_forward_uses_target_bits_and_mixed_blend() -> None:
    m = init_compression(Two(), _section(
        "weight_quantization", {"schedule_offset": 0, "quantize_weight_in_forward": True},
        {"start_bits": 8, "target_bits": 4, "quantization_period": 100}, ["a"]))
    CompressionScheduler(m)
    x = torch.randn(3, 8)
    torch.testing.assert_close(m.a(x), F.linear(x, fake_quantize(m.a.weight, 4), m.a.bias))
    m = init_compression(Two(), _section(
        "weight_quantization", {"schedule_offset": 0,
                                "fp16_mixed_quantize": {"enabled": True, "quantize_change_ratio": 0.25}},
        {"start_bits": 8, "target_bits": 8}, ["a"]))
    sched = CompressionScheduler(m)
    for step, real in ((0, 1.0), (1, 0.75), (3, 0.25), (9, 0.0)):
        sched.step(step)
        w = real * m.a.weight + (1 - real) * fake_quantize(m.a.weight, 8)
        torch.testing.assert_close(m.a(x), F.linear(x, w, m.a.bias))


def test_sparse_l1_mask_starts_at_offset_and_ramps_every_stride() -> None:
    m = init_compression(Two(), _section(
        "sparse_pruning", {"schedule_offset": 2, "schedule_offset_end": 6, "schedule_offset_stride": 2},
        {"dense_ratio": 0.25}, ["a"]))
    sched = CompressionScheduler(m)
    x = torch.randn(4, 8)
    for step, ratio in ((1, None), (2, 1.0), (3, 1.0), (4, 0.625), (6, 0.25), (9, 0.25)):
        sched.step(step)
        w = m.a.weight if ratio is None else m.a.weight * M.l1_mask(m.a.weight, ratio)
        torch.testing.assert_close(m.a(x), F.linear(x, w, m.a.bias))
    assert int(m.a.cq_sparse_mask.sum()) == 32  # ceil(0.25 * 128)


def test_two_four_sparsity_and_topk_scores_get_gradients() -> None:
    m = init_compression(Two(), _section(
        "sparse_pruning", {"schedule_offset": 0, "block_pattern": "2:4"}, {"dense_ratio": 0.5}, ["a", "b"]))
    CompressionScheduler(m)
    x = torch.randn(4, 8)
    torch.testing.assert_close(m.a(x), F.linear(x, m.a.weight * M.nm_mask(m.a.weight, 2, 4), m.a.bias))
    m = init_compression(Two(), _section("sparse_pruning", {"schedule_offset": 0, "method": "topk"},
                                         {"dense_ratio": 0.5}, ["a"]))
    CompressionScheduler(m)
    m(x).sum().backward()
    assert m.a.sparse_mask_scores.grad is not None and m.a.sparse_mask_scores.grad.abs().sum() > 0
    torch.testing.assert_close(m.a(x), F.linear(x, m.a.weight * M.topk_mask(m.a.sparse_mask_scores.detach(), 0.5),
                                                m.a.bias))


def test_row_and_head_masks() -> None:
    m = init_compression(Two(), _section("row_pruning", {"schedule_offset": 1}, {"dense_ratio": 0.5}, ["a"]))
    sched = CompressionScheduler(m)
    x = torch.randn(4, 8)
    torch.testing.assert_close(m.a(x), F.linear(x, m.a.weight, m.a.bias))
    sched.step(1)
    rows = M.topk_mask(M.row_scores_l1(m.a.weight), 0.5)
    out = m.a(x)
    torch.testing.assert_close(out, F.linear(x, m.a.weight * rows, m.a.bias * rows.reshape(-1)))
    assert int((out.abs().sum(0) == 0).sum()) == 8
    m = init_compression(Two(), _section("head_pruning", {"schedule_offset": 0, "num_heads": 4, "method": "l1"},
                                         {"dense_ratio": 0.5}, ["b"]))
    CompressionScheduler(m)
    h = torch.randn(4, 16)
    heads = M.topk_mask(M.head_scores_l1(m.b.weight, 4), 0.5)
    torch.testing.assert_close(m.b(h), F.linear(h, m.b.weight * M.head_columns(heads, 16), m.b.bias))


def test_channel_pruning_on_conv() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1))
    init_compression(m, _section("channel_pruning", {"schedule_offset": 0}, {"dense_ratio": 0.25}, ["^0$"]))
    CompressionScheduler(m)
    x = torch.randn(2, 3, 6, 6)
    keep = M.topk_mask(M.row_scores_l1(m[0].weight), 0.25)
    torch.testing.assert_close(m[0](x), F.conv2d(x, m[0].weight * keep, m[0].bias * keep.reshape(-1)))


def test_activation_quantization_static_range_is_a_momentum_average() -> None:
    m = init_compression(Two(), _section("activation_quantization",
                                         {"schedule_offset": 0, "range_calibration": "static"}, {"bits": 8}, ["a"]))
    CompressionScheduler(m)
    xs = [torch.randn(4, 8) * (i + 1) for i in range(3)]
    lo = hi = None
    for x in xs:
        m.a(x)
        if lo is None:
            lo, hi = x.min(), x.max()
        lo, hi = 0.95 * lo + 0.05 * x.min(), 0.95 * hi + 0.05 * x.max()
    torch.testing.assert_close(m.a.cq_act_range, torch.stack([lo, hi]))
    m.eval()
    x = torch.randn(4, 8)
    expected = F.linear(fake_quantize(x, 8, min_max=(lo, hi)), m.a.weight, m.a.bias)
    torch.testing.assert_close(m.a(x), expected)
    torch.testing.assert_close(m.a.cq_act_range, torch.stack([lo, hi]))  # fixed in eval
    m = init_compression(Two(), _section("activation_quantization", {"schedule_offset": 0}, {"bits": 4}, ["a"]))
    CompressionScheduler(m)
    torch.testing.assert_close(m.a(x), F.linear(fake_quantize(x, 4, groups=4), m.a.weight, m.a.bias))


def test_scheduler_state_restores_masks_and_step() -> None:
    cfg = _section("sparse_pruning", {"schedule_offset": 0}, {"dense_ratio": 0.5}, ["a", "b"])
    m = init_compression(Two(), cfg)
    sched = CompressionScheduler(m)
    sched.step(5)
    m(torch.randn(2, 8))  # masks computed from these weights
    state = sched.state_dict()
    fresh = init_compression(Two(), cfg)
    with torch.no_grad():
        fresh.a.weight.mul_(-3.0).add_(1.0)  # different weights would give a different L1 mask
    other = CompressionScheduler(fresh)
    other.load_state_dict(state)
    assert other.training_steps == 5 and fresh.a.step == 5
    assert torch.equal(fresh.a.cq_sparse_mask, m.a.cq_sparse_mask)
