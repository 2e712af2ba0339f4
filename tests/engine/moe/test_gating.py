"""The MoE gate and layer on one process: capacity, which assignments a full expert drops (against
a plain-Python reference of each keep rule), dropless routing, the auxiliary loss, gate
normalization, noisy gates, auxiliary-loss-free bias balancing, the grouped expert GEMMs against the
loop, the layer's output against a direct per-token computation, Residual MoE, and DeepSpeed's names."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepfleet.engine.moe.dispatch import route
from deepfleet.engine.moe.experts import Experts
from deepfleet.engine.moe.gating import TopKGate, capacity_for
from deepfleet.engine.moe.layer import MoE
from deepfleet.engine.moe.utils import (
    has_moe_layers,
    is_moe_param,
    place_expert_param_groups,
    split_params_into_different_moe_groups_for_optimizer,
)


def mlp(d: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d))


@pytest.mark.parametrize(("tokens", "experts", "factor", "k", "minimum", "expected"), [
    (32, 4, 1.0, 1, 4, 8), (30, 4, 1.0, 1, 4, 8), (10, 4, 1.0, 1, 4, 4), (32, 4, 1.0, 2, 4, 16),
    (33, 8, 1.25, 1, 0, 6), (12, 4, 0.5, 3, 1, 5),
])
def test_capacity_is_deepspeeds_formula(tokens, experts, factor, k, minimum, expected) -> None:
    assert capacity_for(tokens, experts, capacity_factor=factor, k=k, min_capacity=minimum) == expected
    assert expected == max(math.ceil(tokens / experts * factor * k), minimum)


def reference_keep(topk_idx: torch.Tensor, capacity: int, *, scores: torch.Tensor | None) -> torch.Tensor:
    """Plain-Python keep rule: slot-major token order, or highest score first when scores are given."""
    tokens, k = topk_idx.shape
    if scores is None:
        order = [(t, j) for j in range(k) for t in range(tokens)]
    else:
        order = sorted(((t, j) for t in range(tokens) for j in range(k)), key=lambda a: -float(scores[a]))
    used = [0] * (int(topk_idx.max()) + 1)
    keep = torch.zeros(tokens, k, dtype=torch.bool)
    for t, j in order:
        e = int(topk_idx[t, j])
        if used[e] < capacity:
            keep[t, j], used[e] = True, used[e] + 1
    return keep


@pytest.mark.parametrize(("k", "tokens", "factor"), [(1, 37, 1.0), (2, 29, 0.5), (3, 23, 0.4), (1, 50, 0.3)])
def test_dropping_matches_the_reference(k: int, tokens: int, factor: float) -> None:
    torch.manual_seed(k + tokens)
    gate = TopKGate(8, 5, k=k, capacity_factor=factor, min_capacity=1, use_rts=False,
                    top2_2nd_expert_sampling=False)
    r = gate(torch.randn(tokens, 8))
    assert r.capacity == capacity_for(tokens, 5, capacity_factor=factor, k=k, min_capacity=1)
    row_map, kept = route(r.topk_idx, num_experts=5, capacity=r.capacity, priority=r.priority)
    expected = reference_keep(r.topk_idx, r.capacity, scores=r.priority)
    assert torch.equal(row_map >= 0, expected)
    assert torch.equal(kept, torch.bincount(r.topk_idx[expected], minlength=5))
    assert torch.equal(r.exp_counts, torch.bincount(r.topk_idx.reshape(-1), minlength=5))  # before dropping
    assert int((row_map < 0).sum()) > 0  # the case really drops
    rows = row_map[row_map >= 0]
    assert rows.unique().numel() == rows.numel() and bool((rows // r.capacity == r.topk_idx[row_map >= 0]).all())


def test_random_token_selection_keeps_capacity_tokens_at_random() -> None:
    x = torch.randn(64, 8)
    gate = TopKGate(8, 4, k=1, min_capacity=1, capacity_factor=0.5)
    kept_sets = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        r = gate(x)
        row_map, kept = route(r.topk_idx, num_experts=4, capacity=r.capacity, priority=r.priority)
        assert torch.equal(kept, r.exp_counts.clamp(max=r.capacity))
        kept_sets.append(row_map[:, 0] >= 0)
    assert not torch.equal(*kept_sets)


def test_dropless_keeps_every_assignment() -> None:
    gate = TopKGate(8, 4, k=2, drop_tokens=False)
    r = gate(torch.randn(40, 8))
    row_map, kept = route(r.topk_idx, num_experts=4, capacity=r.capacity, priority=r.priority)
    assert r.capacity is None and bool((row_map >= 0).all()) and int(kept.sum()) == 80


@pytest.mark.parametrize("k", [1, 2, 4])
def test_aux_loss(k: int) -> None:
    torch.manual_seed(0)
    gate = TopKGate(8, 6, k=k, top2_2nd_expert_sampling=False)
    x = torch.randn(50, 8)
    r = gate(x)
    probs = F.softmax(x @ gate.wg.weight.t(), dim=-1)
    chosen = probs.topk(k, dim=1).indices if k > 2 else probs.argmax(1, keepdim=True)
    fraction = F.one_hot(chosen, 6).sum(1).float().mean(0)
    expected = (probs.mean(0) * fraction).sum() * 6 / (k if k > 2 else 1)
    torch.testing.assert_close(r.l_aux, expected)
    r.l_aux.backward()
    assert gate.wg.weight.grad.abs().sum() > 0


def test_layer_equals_a_direct_per_token_computation() -> None:
    torch.manual_seed(3)
    for k, drop in ((1, True), (2, True), (2, False), (3, True)):
        layer = MoE(8, mlp(), num_experts=4, k=k, capacity_factor=0.7, min_capacity=1, drop_tokens=drop,
                    use_rts=False, top2_2nd_expert_sampling=False)
        for p in layer.parameters():  # distinct experts
            nn.init.normal_(p, std=0.3)
        x = torch.randn(3, 7, 8)
        out, l_aux, counts = layer(x)
        flat = x.reshape(-1, 8)
        r = layer.deepspeed_moe.gate(flat)
        row_map, _ = route(r.topk_idx, num_experts=4, capacity=r.capacity, priority=r.priority)
        keep = row_map >= 0
        experts = list(layer.deepspeed_moe.experts.deepspeed_experts.values())
        expected = torch.zeros_like(flat)
        for t in range(flat.shape[0]):
            g = torch.where(keep[t], r.gates[t], 0.0)
            if k > 1:
                g = g / g.sum().clamp(min=torch.finfo(g.dtype).eps)
            for j in range(k):
                if keep[t, j]:
                    expected[t] += g[j] * experts[int(r.topk_idx[t, j])](flat[t])
        torch.testing.assert_close(out.reshape(-1, 8), expected, atol=1e-5, rtol=1e-5)
        assert out.shape == x.shape and l_aux.dim() == 0 and counts.shape == (4,)


def test_grouped_gemms_equal_the_loop() -> None:
    torch.manual_seed(0)
    experts = Experts(mlp(), 3)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.3)
    experts.grad_scale = 0.5
    rows, counts = torch.randn(11, 8, requires_grad=True), [4, 0, 7]
    grad = torch.randn(11, 8)
    results = []
    for fn in (experts.reference, lambda r, c: experts._grouped(r, c, list(experts.deepspeed_experts.values()))):
        rows.grad = None
        experts.zero_grad()
        out = fn(rows, counts)
        out.backward(grad)
        results.append((out.detach(), rows.grad.clone(), [p.grad.clone() for p in experts.parameters()]))
    (a, ga, pa), (b, gb, pb) = results
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gb, ga, atol=1e-5, rtol=1e-5)
    for x, y in zip(pa, pb, strict=True):
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", [0.5, 1.0 / 3.0])
def test_grad_scale_scales_only_the_expert_gradients(scale: float) -> None:
    """`grad_scale` (1 / ep) multiplies every expert parameter's gradient and leaves the outputs and
    the rows' gradient as an unscaled per-expert loop computes them."""
    torch.manual_seed(0)
    experts = Experts(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.LayerNorm(8)), 3)
    rows, counts = torch.randn(13, 8, requires_grad=True), [5, 0, 8]
    grad = torch.randn(13, 8)
    want = experts.reference(rows, counts)
    want.backward(grad)
    want_rows, want_params = rows.grad.clone(), [p.grad.clone() for p in experts.parameters()]
    rows.grad = None
    experts.zero_grad()
    experts.grad_scale = scale
    out = experts(rows, counts)
    out.backward(grad)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(rows.grad, want_rows, atol=1e-6, rtol=1e-6)
    for p, g in zip(experts.parameters(), want_params, strict=True):
        torch.testing.assert_close(p.grad, g * scale, atol=1e-6, rtol=1e-6)
    if scale == 0.5:  # a power of two: exact
        assert torch.equal(rows.grad, want_rows)


def test_noisy_gates_change_routing_only_while_training() -> None:
    x = torch.randn(4000, 8)
    for policy in ("Jitter", "RSample"):
        gate = TopKGate(8, 4, noisy_gate_policy=policy, drop_tokens=False)
        nn.init.normal_(gate.wg.weight, std=0.01)  # near-ties, so noise matters
        torch.manual_seed(0)
        a = gate(x).topk_idx
        torch.manual_seed(1)
        b = gate(x).topk_idx
        assert not torch.equal(a, b)
        gate.eval()
        assert torch.equal(gate(x).topk_idx, gate(x).topk_idx)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        TopKGate(8, 4, noisy_gate_policy="Gaussian")


def test_bias_balancing_evens_out_a_skewed_router() -> None:
    torch.manual_seed(0)
    gate = TopKGate(8, 4, k=1, drop_tokens=False, bias_update_rate=0.05)
    with torch.no_grad():
        gate.wg.weight[0] += 0.5  # expert 0 is favoured
    x = torch.randn(256, 8).abs()
    first = gate(x).exp_counts.clone()
    for _ in range(60):
        gate.update_expert_bias(gate.load_counts.clone())
        gate(x)
    last = gate(x).exp_counts
    assert first.max() - first.min() > 100 and last.max() - last.min() < (first.max() - first.min()) / 3
    assert gate.expert_bias[0] < 0  # the favoured expert was made less attractive
    assert gate(x).gates.max() <= 1.0  # gate values stay bias-free probabilities


def test_residual_moe_mixes_the_dense_branch() -> None:
    torch.manual_seed(0)
    layer = MoE(8, mlp(), num_experts=2, use_residual=True, drop_tokens=False)
    x = torch.randn(5, 8)
    out, _, _ = layer(x)
    coef = F.softmax(layer.coefficient(x), dim=-1)
    expected = layer.deepspeed_moe(x) * coef[:, :1] + layer.mlp(x) * coef[:, 1:]
    torch.testing.assert_close(out, expected)


def test_deepspeed_names_and_param_groups() -> None:
    model = nn.Sequential(nn.Linear(8, 8), MoE(8, mlp(), num_experts=2))
    names = [n for n, _ in model.named_parameters()]
    assert "1.deepspeed_moe.gate.wg.weight" in names
    assert "1.deepspeed_moe.experts.deepspeed_experts.1.2.bias" in names
    assert has_moe_layers(model) == (True, 2)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters", "lr": 0.1})
    assert [g["name"] for g in groups] == ["parameters", "ep_size_1"] and groups[1]["moe"] is True
    assert groups[1]["lr"] == 0.1 and all(is_moe_param(p) for p in groups[1]["params"])
    assert not any(is_moe_param(p) for p in groups[0]["params"])
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(names)
    placed = place_expert_param_groups([{"params": list(model.parameters())}])
    assert len(placed) == 2 and "process_group" not in placed[1]  # ep 1: experts stay data parallel
    with pytest.raises(ValueError, match="used_token"):
        model[1](torch.randn(2, 8), torch.ones(2))


@pytest.mark.parametrize("drop", [True, False])
def test_bf16_layer_keeps_its_dtype_and_backpropagates(drop: bool) -> None:
    torch.manual_seed(0)
    layer = MoE(8, mlp(), num_experts=4, k=2, drop_tokens=drop).to(torch.bfloat16)
    x = torch.randn(2, 6, 8, dtype=torch.bfloat16, requires_grad=True)
    out, l_aux, _ = layer(x)
    assert out.dtype == torch.bfloat16 and l_aux.dtype == torch.float32
    (out.float().pow(2).sum() + l_aux).backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad.float()).all())
    assert layer.deepspeed_moe.gate.wg.weight.grad.abs().sum() > 0
