"""GPU checks (`-m gpu`, skipped without CUDA): on CUDA tensors `auto` picks Triton, which then compiles
for the device (no interpreter) and must match the reference at realistic sizes; the cross-entropy
kernel must also use less peak memory than the reference. Run by `benchmarks/gpu_check.sh`."""

from __future__ import annotations

import pytest
import torch

from deepfleet.kernels import _dispatch
from deepfleet.kernels._dispatch import force_impl
from deepfleet.kernels.cross_entropy import cross_entropy, cross_entropy_reference
from deepfleet.kernels.fused_adamw import fused_adamw
from deepfleet.kernels.geglu import geglu, geglu_reference
from deepfleet.kernels.layer_norm import layer_norm, layer_norm_reference
from deepfleet.kernels.moe_permute import moe_permute, moe_unpermute
from deepfleet.kernels.onebit_pack import onebit_pack, onebit_pack_reference
from deepfleet.kernels.rms_norm import rms_norm, rms_norm_op, rms_norm_reference
from deepfleet.kernels.rope import rope, rope_cos_sin, rope_reference
from deepfleet.kernels.swiglu import swiglu, swiglu_reference
from tests.kernels.tolerance import assert_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grads(fn, inputs, dy):
    out = fn(*inputs)
    return (out, *torch.autograd.grad(out, [t for t in inputs if t.requires_grad], dy))


def test_auto_selects_compiled_triton_on_cuda() -> None:
    assert not _dispatch.interpreting(), "run GPU tests with -m gpu so Triton compiles for the device"
    with force_impl("auto"):
        assert _dispatch.use_triton(torch.zeros(1, device="cuda"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(4096, 4096), (3, 5, 8191), (2048, 1)], ids=str)
def test_norms_and_glus_match_reference(shape, dtype) -> None:
    n = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(n, device="cuda", dtype=dtype, requires_grad=True)
    u = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, device="cuda", dtype=dtype)
    pairs = {
        "rms_norm": (rms_norm, rms_norm_reference, (x, w)),
        "layer_norm": (layer_norm, layer_norm_reference, (x, w, b)),
        "swiglu": (swiglu, swiglu_reference, (x, u)),
        "geglu": (geglu, geglu_reference, (x, u)),
    }
    for name, (op, ref, inputs) in pairs.items():
        want = _grads(ref, inputs, dy)
        got = _grads(op, inputs, dy)
        for i, (a, e) in enumerate(zip(got, want, strict=True)):
            is_param_grad = i >= 2 and name.endswith("norm")
            assert_close(f"gpu.{name}.{i}", a, e, scale=8.0 if is_param_grad else 2.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_and_moe_match_reference(dtype) -> None:
    x = torch.randn(2, 1024, 16, 128, device="cuda", dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(1024, 128, device="cuda")
    dy = torch.randn_like(x)
    for a, e in zip(_grads(lambda t: rope(t, cos, sin), (x,), dy), _grads(lambda t: rope_reference(t, cos, sin), (x,), dy), strict=True):
        assert_close("gpu.rope", a, e)
    tokens = torch.randn(4096, 1024, device="cuda", dtype=dtype, requires_grad=True)
    topk = torch.rand(4096, 32, device="cuda").topk(2, dim=-1).indices
    gates = torch.rand(4096, 2, device="cuda").softmax(-1).requires_grad_()
    results = {}
    for impl in ("triton", "torch"):
        with force_impl(impl):
            perm, row_map, _ = moe_permute(tokens, topk, num_experts=32, capacity=300)
            out = moe_unpermute(perm * 2, row_map, gates)
            results[impl] = (perm, out, *torch.autograd.grad(out, (tokens, gates), torch.ones_like(out)))
    for a, e in zip(results["triton"], results["torch"], strict=True):
        assert_close("gpu.moe", a, e, scale=4.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_matches_reference_with_less_memory(dtype) -> None:
    logits = torch.randn(2048, 128256, device="cuda", dtype=dtype, requires_grad=True)
    target = torch.randint(0, 128256, (2048,), device="cuda")
    target[::7] = -100
    peaks, grads = {}, {}
    for name, fn in (("triton", cross_entropy), ("reference", cross_entropy_reference)):
        logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = fn(logits, target, label_smoothing=0.1)
        loss.backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        grads[name] = (loss.detach(), logits.grad)
    assert_close("gpu.cross_entropy.loss", grads["triton"][0], grads["reference"][0], scale=10.0)
    assert_close("gpu.cross_entropy.dlogits", grads["triton"][1], grads["reference"][1], scale=2.0)
    if dtype == torch.float32:  # no upcast to save: the reference holds log-probs and two gradients
        assert peaks["triton"] < peaks["reference"], peaks
    else:  # the reference also upcasts the logits to fp32
        assert peaks["triton"] * 2 <= peaks["reference"], peaks


def test_fused_adamw_matches_torch_adamw() -> None:
    p = torch.randn(10_000_019, device="cuda")
    torch_p = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([torch_p], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    model = p.to(torch.bfloat16)
    for step in range(1, 4):
        g = torch.randn_like(p)
        torch_p.grad = g.clone()
        opt.step()
        found = fused_adamw([p], [g * 256], [m], [v], model_params=[model], grad_scale=torch.tensor(256.0, device="cuda"),
                            lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, step=step)  # fmt: skip
        assert found.item() == 0.0
    torch.testing.assert_close(p, torch_p.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model, p.to(torch.bfloat16), atol=0, rtol=0)


def test_onebit_matches_reference() -> None:
    x = torch.randn(10_000_001, device="cuda")
    err_ref = 0.01 * torch.randn_like(x)
    err = err_ref.clone()
    packed, scales = onebit_pack(x, err, chunk_size=2048)
    packed_ref, scales_ref = onebit_pack_reference(x, err_ref, 2048)
    assert torch.equal(packed, packed_ref)
    assert_close("gpu.onebit.scales", scales, scales_ref)
    assert_close("gpu.onebit.error", err, err_ref)


def test_opcheck_on_cuda() -> None:
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    w = torch.randn(256, device="cuda", requires_grad=True)
    torch.library.opcheck(rms_norm_op, (x, w, 1e-6))
