"""Every Triton kernel compiles for a Hopper GPU (sm_90: H100/H200) down to a cubin, on this GPU-less
machine: the interpreter used by the other tests runs kernels as numpy and would not catch what only the
real compiler rejects (types, layouts, unsupported ops). Uses Triton's ahead-of-time `compile` entry with
representative argument types and every compile-time variant the launchers use, in a child process
without TRITON_INTERPRET (a process where kernels were decorated for the interpreter cannot compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

P_BF16, P_FP32, P_I64, P_I32, P_U8 = "*bf16", "*fp32", "*i64", "*i32", "*u8"

# (module, kernel, argument types in order, compile-time constants)
KERNELS = [
    ("rms_norm", "_rms_norm_fwd", [P_BF16, P_BF16, P_BF16, P_FP32, "i32", "i32", "fp32"], {"ROWS": 8, "BLOCK": 512}),
    ("rms_norm", "_rms_norm_fwd", [P_BF16, P_BF16, P_BF16, P_FP32, "i32", "i32", "fp32"], {"ROWS": 1, "BLOCK": 8192}),
    ("rms_norm", "_rms_norm_bwd", [P_BF16] * 3 + [P_FP32, P_BF16, P_FP32, "i32", "i32", "i32"], {"ROWS": 1, "BLOCK": 4096}),
    ("layer_norm", "_layer_norm_fwd", [P_BF16] * 4 + [P_FP32, P_FP32, "i32", "i32", "fp32"],
     {"HAS_BIAS": True, "ROWS": 4, "BLOCK": 1024}),
    ("layer_norm", "_layer_norm_fwd", [P_BF16] * 4 + [P_FP32, P_FP32, "i32", "i32", "fp32"],
     {"HAS_BIAS": False, "ROWS": 1, "BLOCK": 8192}),
    ("layer_norm", "_layer_norm_bwd", [P_BF16] * 3 + [P_FP32, P_FP32, P_BF16, P_FP32, P_FP32, "i32", "i32", "i32"],
     {"ROWS": 2, "BLOCK": 2048}),
    ("cross_entropy", "_cross_entropy_fwd", [P_BF16, P_I64, P_FP32, P_BF16, "i32", "i32", "fp32"],
     {"COMPUTE_GRAD": True, "BLOCK": 8192}),
    ("cross_entropy", "_cross_entropy_fwd", [P_BF16, P_I64, P_FP32, P_BF16, "i32", "i32", "fp32"],
     {"COMPUTE_GRAD": False, "BLOCK": 8192}),
    ("cross_entropy", "_scale_rows", [P_BF16, P_FP32, P_BF16, "i32"], {"BLOCK": 8192}),
    ("fused_adamw", "_check_finite", [P_I64, P_I64, P_I64, P_I64, P_FP32, P_I32], {"G_DT": "bf16", "BLOCK": 1024}),
    ("fused_adamw", "_adamw", [P_I64] * 8 + [P_FP32, P_I32] + ["fp32"] * 7,
     {"P_DT": "fp32", "G_DT": "bf16", "M_DT": "fp32", "V_DT": "fp32", "MODEL_DT": "bf16",
      "HAS_MODEL": True, "HAS_SCALE": True, "BLOCK": 1024}),
    ("glu", "_glu_fwd", [P_BF16] * 3 + ["i32"], {"ACT": 0, "BLOCK": 1024}),
    ("glu", "_glu_fwd", [P_BF16] * 3 + ["i32"], {"ACT": 1, "BLOCK": 1024}),
    ("glu", "_glu_bwd", [P_BF16] * 5 + ["i32"], {"ACT": 2, "BLOCK": 1024}),
    ("rope", "_rope", [P_BF16, P_FP32, P_FP32, P_BF16, "i32", "i32", "i32", "fp32"], {"HEADS": 32, "HALF": 64}),
    ("onebit_pack", "_pack", [P_FP32, P_FP32, P_U8, P_FP32, "i32", "i32"], {"BYTES": 256}),
    ("onebit_pack", "_unpack", [P_U8, P_FP32, P_BF16, "i32", "i32"], {"BYTES": 256}),
    ("moe_permute", "_permute", [P_BF16, P_I64, P_BF16, "i32", "i32"], {"BLOCK": 1024}),
    ("moe_permute", "_unpermute", [P_BF16, P_I64, P_FP32, P_BF16, "i32", "i32"], {"BLOCK": 1024}),
    ("moe_permute", "_unpermute_bwd", [P_BF16, P_BF16, P_I64, P_FP32, P_BF16, P_FP32, "i32", "i32"], {"BLOCK": 1024}),
]  # fmt: skip
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


COMPILE_ALL = textwrap.dedent(
    """
    import importlib, json, sys
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    failures = []
    for module, name, types, constants in json.loads(sys.argv[1]):
        jit = getattr(importlib.import_module("deepfleet.kernels._triton." + module), name)
        constexprs = {k: (getattr(tl, DTYPES[v]) if k.endswith("_DT") else v) for k, v in constants.items()}
        runtime = [p for p in jit.arg_names if p not in constexprs]
        try:
            assert len(runtime) == len(types), (runtime, types)
            signature = dict(zip(runtime, types)) | {k: "constexpr" for k in constexprs}
            source = ASTSource(fn=jit, signature=signature, constexprs=constexprs)
            assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]
        except Exception as e:
            failures.append(f"{module}.{name} {constants}: {type(e).__name__}: {e}"[:2000])
    print(json.dumps(failures))
    """
)


def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_DEFAULT_FP_FUSION": "1", "OMP_NUM_THREADS": "1"}
    code = f"DTYPES = {DTYPES!r}\n" + COMPILE_ALL
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code, json.dumps(KERNELS)],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    failures = json.loads(result.stdout.strip().splitlines()[-1])
    assert failures == [], "\n".join(failures)
