"""Fused AdamW: the reference against torch.optim.AdamW in float64, master/model-copy and loss-scale
semantics, Triton (interpreted) against the reference over odd shapes and precision setups, overflow
reporting, and the custom op's registrations."""

from __future__ import annotations

import pytest
import torch

from deepfleet.kernels._dispatch import force_impl
from deepfleet.kernels.fused_adamw import fused_adamw, fused_adamw_op, fused_adamw_reference
from tests.kernels.tolerance import assert_close

SHAPES = [(1, 1), (3, 17), (9, 41, 341)]
HP = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}


def _group(shapes, *, grad_dtype, model_dtype=None, state_dtype=torch.float32):
    params = [torch.randn(s) for s in shapes]
    return {
        "params": params,
        "grads": [torch.randn(s).to(grad_dtype) for s in shapes],
        "exp_avgs": [torch.zeros(s, dtype=state_dtype) for s in shapes],
        "exp_avg_sqs": [torch.zeros(s, dtype=state_dtype) for s in shapes],
        "model_params": [p.to(model_dtype) for p in params] if model_dtype else [],
    }


def _clone(group):
    return {k: [t.clone() for t in v] for k, v in group.items()}


def test_reference_matches_torch_adamw_in_float64() -> None:
    p = [torch.randn(5, 3, dtype=torch.float64), torch.randn(7, dtype=torch.float64)]
    mine = [t.clone() for t in p]
    torch_params = [torch.nn.Parameter(t.clone()) for t in p]
    opt = torch.optim.AdamW(torch_params, lr=HP["lr"], betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    m, v = [torch.zeros_like(t) for t in p], [torch.zeros_like(t) for t in p]
    for step in range(1, 4):
        grads = [torch.randn_like(t) for t in p]
        for tp, g in zip(torch_params, grads, strict=True):
            tp.grad = g.clone()
        opt.step()
        fused_adamw_reference(mine, grads, m, v, [], None, step=step, **HP)
    for a, b in zip(mine, torch_params, strict=True):
        torch.testing.assert_close(a, b.detach(), atol=1e-12, rtol=1e-12)


def test_reference_grad_scale_unscales_and_skips_on_overflow() -> None:
    plain = _group([(4, 4)], grad_dtype=torch.float32)
    scaled = _clone(plain)
    scaled["grads"] = [g * 1024.0 for g in scaled["grads"]]
    assert fused_adamw_reference(**plain, grad_scale=None, step=1, **HP).item() == 0.0
    assert fused_adamw_reference(**scaled, grad_scale=torch.tensor(1024.0), step=1, **HP).item() == 0.0
    torch.testing.assert_close(scaled["params"][0], plain["params"][0])
    before = _clone(scaled)
    scaled["grads"][0][1, 2] = float("inf")
    assert fused_adamw_reference(**scaled, grad_scale=torch.tensor(1024.0), step=2, **HP).item() == 1.0
    for k in ("params", "exp_avgs", "exp_avg_sqs"):
        assert torch.equal(scaled[k][0], before[k][0])


SETUPS = {  # name -> (grad dtype, model copy dtype, grad scale)
    "fp32": (torch.float32, None, None),
    "bf16-master": (torch.bfloat16, torch.bfloat16, None),
    "fp16-master-scaled": (torch.float16, torch.float16, 512.0),
}


@pytest.mark.parametrize("setup", list(SETUPS))
def test_triton_matches_reference(setup: str) -> None:
    grad_dtype, model_dtype, scale = SETUPS[setup]
    ref = _group(SHAPES, grad_dtype=grad_dtype, model_dtype=model_dtype)
    tri = _clone(ref)
    grad_scale = None if scale is None else torch.tensor(scale)
    for step in range(1, 4):
        grads = [torch.randn(s).to(grad_dtype) for s in SHAPES]
        ref["grads"] = [g.clone() for g in grads]
        tri["grads"] = [g.clone() for g in grads]
        found_ref = fused_adamw_reference(**ref, grad_scale=grad_scale, step=step, **HP)
        with force_impl("triton"):
            found = fused_adamw(**tri, grad_scale=grad_scale, step=step, betas=(HP["beta1"], HP["beta2"]),
                                lr=HP["lr"], eps=HP["eps"], weight_decay=HP["weight_decay"])  # fmt: skip
        assert found.item() == found_ref.item() == 0.0
    for key in ("params", "exp_avgs", "exp_avg_sqs", "model_params"):
        for a, b in zip(tri[key], ref[key], strict=True):
            assert_close(f"fused_adamw.{key}", a, b)


def test_triton_reports_overflow_and_leaves_state_untouched() -> None:
    group = _group([(3, 17), (40,)], grad_dtype=torch.float16, model_dtype=torch.float16)
    group["grads"][1][7] = float("nan")
    before = _clone(group)
    with force_impl("triton"):
        found = fused_adamw(**group, grad_scale=torch.tensor(8.0), lr=1e-2, step=1)
    assert found.item() == 1.0
    for key, tensors in group.items():
        for a, b in zip(tensors, before[key], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=key)


def test_opcheck(opcheck) -> None:
    g = _group([(3, 5), (4,)], grad_dtype=torch.bfloat16, model_dtype=torch.bfloat16)
    args = (g["params"], g["grads"], g["exp_avgs"], g["exp_avg_sqs"], g["model_params"], torch.tensor(4.0))
    opcheck(fused_adamw_op, (*args, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1))


def test_triton_rejects_mixed_dtypes_within_a_role() -> None:
    g = _group([(3, 5), (4,)], grad_dtype=torch.float32)
    g["grads"][1] = g["grads"][1].to(torch.bfloat16)
    with force_impl("triton"), pytest.raises(ValueError, match="grads must share one dtype"):
        fused_adamw(**g, lr=1e-3, step=1)


def test_rejects_mismatched_group() -> None:
    g = _group([(3, 5)], grad_dtype=torch.float32)
    g["exp_avgs"] = [torch.zeros(5, 3)]
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] shape"):
        fused_adamw(**g, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="grad_scale must be a one-element tensor"):
        fused_adamw(**_group([(2,)], grad_dtype=torch.float32), lr=1e-3, step=1, grad_scale=torch.ones(2))
    with pytest.raises(ValueError, match="step=0"):
        fused_adamw(**_group([(2,)], grad_dtype=torch.float32), lr=1e-3, step=0)
