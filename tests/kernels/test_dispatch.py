"""Implementation selection: DEEPFLEET_KERNELS and force_impl, and the guarantee that every op imports
and runs its reference with triton absent (and never imports triton on the reference path)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepfleet.kernels import _dispatch
from deepfleet.kernels._dispatch import force_impl, selected_impl, use_triton

OP_MODULES = [
    "cross_entropy", "fused_adamw", "geglu", "layer_norm", "moe_permute", "onebit_pack", "rms_norm", "rope", "swiglu",
]  # fmt: skip

# Runs every op once on CPU and checks it against its reference; used with and without triton importable.
RUN_EVERY_OP = textwrap.dedent(
    """
    import importlib, os, sys
    import torch
    torch.manual_seed(0)
    mods = {n: importlib.import_module("deepfleet.kernels." + n) for n in OPS}
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    y = mods["rms_norm"].rms_norm(x, w)
    y.sum().backward()
    assert torch.allclose(y, mods["rms_norm"].rms_norm_reference(x, w))
    assert torch.allclose(mods["layer_norm"].layer_norm(x, w, w), mods["layer_norm"].layer_norm_reference(x, w, w))
    assert torch.allclose(mods["swiglu"].swiglu(x, x), mods["swiglu"].swiglu_reference(x, x))
    assert torch.allclose(mods["geglu"].geglu(x, x), mods["geglu"].geglu_reference(x, x))
    t = torch.tensor([1, -100, 7])
    ce = mods["cross_entropy"]
    assert torch.allclose(ce.cross_entropy(x, t), ce.cross_entropy_reference(x, t))
    cos, sin = mods["rope"].rope_cos_sin(3, 8)
    q = x.detach().view(1, 3, 1, 8)
    assert torch.allclose(mods["rope"].rope(q, cos, sin), mods["rope"].rope_reference(q, cos, sin))
    p = [torch.randn(5)]
    found = mods["fused_adamw"].fused_adamw(p, [torch.randn(5)], [torch.zeros(5)], [torch.zeros(5)], lr=0.1, step=1)
    assert found.item() == 0.0
    packed, scales = mods["onebit_pack"].onebit_pack(torch.randn(20), torch.zeros(20), chunk_size=8)
    assert packed.dtype == torch.uint8 and scales.shape == (3,)
    perm, row_map, counts = mods["moe_permute"].moe_permute(x, torch.tensor([[0], [1], [0]]), num_experts=2)
    assert torch.equal(mods["moe_permute"].moe_unpermute(perm, row_map, torch.ones(3, 1)), x)
    print("TRITON_PATH_LOADED", any(m.startswith("deepfleet.kernels._triton") for m in sys.modules))
    os.environ["DEEPFLEET_KERNELS"] = "triton"
    try:
        mods["swiglu"].swiglu(x, x)
    except RuntimeError as e:
        print("FORCED:", e)
    """
)

BLOCK_TRITON = textwrap.dedent(
    """
    import importlib.abc, sys
    class _NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("triton blocked for this test")
            return None
    sys.meta_path.insert(0, _NoTriton())
    """
)


def _run(code: str, *, env_impl: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "DEEPFLEET_KERNELS": env_impl}
    return subprocess.run(
        [sys.executable, "-W", "error", "-c", f"OPS = {OP_MODULES!r}\n" + code],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip


def test_every_op_runs_its_reference_without_triton() -> None:
    """Importing the op modules with triton blocked also proves the Triton modules load lazily."""
    result = _run(BLOCK_TRITON + RUN_EVERY_OP, env_impl="auto")
    assert result.returncode == 0, result.stderr
    assert "TRITON_PATH_LOADED False" in result.stdout
    assert "FORCED: DEEPFLEET_KERNELS=triton but triton does not import" in result.stdout


def test_env_var_and_force_impl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPFLEET_KERNELS", "torch")
    assert selected_impl() == "torch"
    with force_impl("triton"):
        assert selected_impl() == "triton"
        with force_impl("auto"):
            assert selected_impl() == "auto"
        assert selected_impl() == "triton"
    assert selected_impl() == "torch"
    monkeypatch.setenv("DEEPFLEET_KERNELS", "cuda")
    with pytest.raises(ValueError, match="DEEPFLEET_KERNELS='cuda'.*auto, torch, triton"):
        selected_impl()
    with pytest.raises(ValueError, match="force_impl='fast'"):
        with force_impl("fast"):
            pass


def test_auto_picks_triton_only_for_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(2)
    with force_impl("auto"):
        assert not use_triton(cpu)
    with force_impl("torch"):
        assert not use_triton(cpu)
    with force_impl("triton"):
        assert use_triton(cpu)  # the interpreter is on in these tests
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="needs CUDA tensors"):
            use_triton(cpu)
    assert _dispatch.triton_available()


def test_only_the_triton_subtree_imports_triton() -> None:
    root = Path(_dispatch.__file__).parent
    offenders = []
    for py in root.rglob("*.py"):
        if "_triton" in py.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(py.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "triton" or n.startswith("triton.") for n in names):
                offenders.append(str(py.relative_to(root)))
    assert offenders == []
