"""Kernel benchmarks on a CUDA GPU: Triton vs the eager torch reference vs `torch.compile` of the
reference, per op and size, with the issue's targets checked at the end.

Run by `benchmarks/gpu_check.sh` (after the `-m gpu` tests) or alone:
    python benchmarks/kernels.py [--quick] [--out results.jsonl]
Prints one JSON line per (op, size, mode, impl): median time (triton.testing.do_bench), effective GB/s
from a minimal-traffic byte count (each tensor the op must read or write, once) and, where it matters,
peak extra memory. Then one line per target:
  fused_adamw >= 80% of the measured device-to-device copy bandwidth;
  cross_entropy (vocab >= 50k) >= 2x faster than eager torch and >= 2x less peak memory;
  rms_norm / layer_norm / swiglu / geglu no slower than torch.compile of the reference.
Without CUDA it prints one "skipped" line and exits 0 (it cannot measure anything on a CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepfleet.kernels import cross_entropy as ce  # noqa: E402
from deepfleet.kernels import fused_adamw as adamw  # noqa: E402
from deepfleet.kernels import geglu as geglu_mod  # noqa: E402
from deepfleet.kernels import layer_norm as ln  # noqa: E402
from deepfleet.kernels import moe_permute as moe  # noqa: E402
from deepfleet.kernels import onebit_pack as onebit  # noqa: E402
from deepfleet.kernels import rms_norm as rms  # noqa: E402
from deepfleet.kernels import rope as rope_mod  # noqa: E402
from deepfleet.kernels import swiglu as swiglu_mod  # noqa: E402
from deepfleet.kernels._dispatch import force_impl  # noqa: E402

BF16 = torch.bfloat16
DEV = "cuda"  # "cpu" only for --dry-run (Triton interpreted)
RESULTS: list[dict] = []


def emit(record: dict, out) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
    RESULTS.append(record)


def time_ms(fn: Callable[[], object], grads: list[torch.Tensor]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grads or None, return_mode="median")


def peak_bytes(fn: Callable[[], object]) -> int:
    """Extra device memory the call needs beyond what is already allocated."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def triton_call(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with force_impl("triton"):
            return fn()

    return run


def no_grad(fn: Callable[[], object]) -> Callable[[], object]:
    def run() -> object:
        with torch.no_grad():
            return fn()

    return run


def fwd_bwd(f: Callable[..., torch.Tensor], args: tuple, dy: torch.Tensor) -> Callable[[], None]:
    return lambda: f(*args).backward(dy)


# --- cases: each returns {impl: callable}, bytes moved, grads to clear, whether to measure memory ----------


def case_norm(kind: str, rows: int, n: int, mode: str):
    x = torch.randn(rows, n, device=DEV, dtype=BF16, requires_grad=True)
    w = torch.ones(n, device=DEV, dtype=BF16, requires_grad=True)
    if kind == "rms_norm":
        op, ref, args = rms.rms_norm, rms.rms_norm_reference, (x, w)
    else:
        b = torch.zeros(n, device=DEV, dtype=BF16, requires_grad=True)
        op, ref, args = ln.layer_norm, ln.layer_norm_reference, (x, w, b)
    return _elementwise_case(op, ref, args, mode, fwd_tensors=2, bwd_tensors=3, numel=x.numel())


def case_glu(kind: str, rows: int, n: int, mode: str):
    g = torch.randn(rows, n, device=DEV, dtype=BF16, requires_grad=True)
    u = torch.randn(rows, n, device=DEV, dtype=BF16, requires_grad=True)
    if kind == "swiglu":
        op, ref = swiglu_mod.swiglu, swiglu_mod.swiglu_reference
    else:
        op, ref = (lambda a, b: geglu_mod.geglu(a, b, "tanh")), (lambda a, b: geglu_mod.geglu_reference(a, b, "tanh"))
    return _elementwise_case(op, ref, (g, u), mode, fwd_tensors=3, bwd_tensors=5, numel=g.numel())


def case_rope(batch: int, seq: int, heads: int, dim: int, mode: str):
    x = torch.randn(batch, seq, heads, dim, device=DEV, dtype=BF16, requires_grad=True)
    cos, sin = rope_mod.rope_cos_sin(seq, dim, device=DEV)
    return _elementwise_case(
        lambda a: rope_mod.rope(a, cos, sin), lambda a: rope_mod.rope_reference(a, cos, sin),
        (x,), mode, fwd_tensors=2, bwd_tensors=2, numel=x.numel(),
    )  # fmt: skip


def _elementwise_case(op, ref, args, mode, *, fwd_tensors: int, bwd_tensors: int, numel: int):
    grads = [a for a in args if a.requires_grad]
    compiled = torch.compile(ref)
    if mode == "fwd":
        fns = {
            "triton": triton_call(no_grad(lambda: op(*args))),
            "torch": no_grad(lambda: ref(*args)),
            "compile": no_grad(lambda: compiled(*args)),
        }
        return fns, fwd_tensors * numel * 2, [], False
    dy = torch.randn_like(ref(*args))
    fns = {
        "triton": triton_call(fwd_bwd(op, args, dy)),
        "torch": fwd_bwd(ref, args, dy),
        "compile": fwd_bwd(compiled, args, dy),
    }
    return fns, (fwd_tensors + bwd_tensors) * numel * 2, grads, False


def case_cross_entropy(rows: int, vocab: int, mode: str):
    logits = torch.randn(rows, vocab, device=DEV, dtype=BF16, requires_grad=True)
    target = torch.randint(0, vocab, (rows,), device=DEV)
    compiled = torch.compile(ce.cross_entropy_reference)
    fns = {
        "triton": triton_call(lambda: ce.cross_entropy(logits, target).backward()),
        "torch": lambda: ce.cross_entropy_reference(logits, target).backward(),
        "torch_F_bf16": lambda: torch.nn.functional.cross_entropy(logits, target).backward(),
        "compile": lambda: compiled(logits, target).backward(),
    }
    return fns, 2 * logits.numel() * 2, [logits], True  # read logits, write their gradient


def case_fused_adamw(numel: int, mode: str):
    def group():
        p = torch.randn(numel, device=DEV)
        return {
            "params": [p], "grads": [torch.randn(numel, device=DEV, dtype=BF16)],
            "exp_avgs": [torch.zeros_like(p)], "exp_avg_sqs": [torch.zeros_like(p)], "model_params": [p.to(BF16)],
        }  # fmt: skip

    g = group()
    hp = {"lr": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "step": 10}
    compiled = torch.compile(adamw.fused_adamw_reference)
    torch_param = torch.nn.Parameter(torch.randn(numel, device=DEV))
    torch_param.grad = torch.randn(numel, device=DEV)
    torch_opt = torch.optim.AdamW([torch_param], lr=1e-4, fused=True)
    fns = {
        "triton": triton_call(lambda: adamw.fused_adamw(**g, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, step=10)),
        "torch": lambda: adamw.fused_adamw_reference(**g, grad_scale=None, **hp),
        "compile": lambda: compiled(**g, grad_scale=None, **hp),
        "torch_AdamW_fused_fp32": torch_opt.step,  # its own traffic: 32 B/element, no model copy
    }
    # read p, g(bf16), m, v; write p, m, v, model copy (bf16): 4+2+4+4 + 4+4+4+2 bytes per element
    return fns, 28 * numel, [], False


def case_onebit(numel: int, mode: str):
    x = torch.randn(numel, device=DEV)
    err = torch.zeros(numel, device=DEV)
    compiled_pack = torch.compile(onebit.onebit_pack_reference)
    compiled_unpack = torch.compile(onebit.onebit_unpack_reference)

    def round_trip(pack, unpack):
        return unpack(*pack(x, err, 2048), numel, 2048, torch.float32)

    fns = {
        "triton": triton_call(lambda: onebit.onebit_unpack(*onebit.onebit_pack(x, err), numel=numel)),
        "torch": lambda: round_trip(onebit.onebit_pack_reference, onebit.onebit_unpack_reference),
        "compile": lambda: round_trip(compiled_pack, compiled_unpack),
    }
    # pack: read x, read+write error, write bits; unpack: read bits, write values
    return fns, numel * (4 + 8 + 4) + 2 * math.ceil(numel / 8), [], False


def case_moe(tokens: int, d: int, experts: int, k: int, mode: str):
    x = torch.randn(tokens, d, device=DEV, dtype=BF16, requires_grad=True)
    topk = torch.rand(tokens, experts, device=DEV).topk(k, dim=-1).indices
    gates = torch.rand(tokens, k, device=DEV).softmax(-1).requires_grad_()
    capacity = math.ceil(1.25 * tokens * k / experts)
    row_map, _ = moe.moe_route(topk, num_experts=experts, capacity=capacity)
    rows = experts * capacity

    def run(permute, unpermute):
        def go():
            out = unpermute(permute(x, row_map, rows), row_map, gates)
            out.backward(torch.ones_like(out))

        return go

    fns = {
        "triton": triton_call(run(moe.moe_permute_op, moe.moe_unpermute_op)),
        "torch": run(moe.moe_permute_reference, moe.moe_unpermute_reference),
        "compile": run(torch.compile(moe.moe_permute_reference), torch.compile(moe.moe_unpermute_reference)),
    }
    # fwd: read x, write k copies, read them, write out; bwd: the same traffic again
    return fns, 2 * (2 * tokens * d + 2 * tokens * k * d) * 2, [x, gates], False


def copy_bandwidth() -> float:
    src = torch.empty(2**28, device=DEV)  # 1 GiB
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), [])
    return 2 * src.numel() * 4 / ms / 1e6  # GB/s


SIZES = {  # full sizes; --quick divides the leading dims by 4, --dry-run uses tiny ones on the CPU
    "norm": [(32768, 4096), (16384, 8192)],
    "glu": [(16384, 11008)],
    "rope": [(8, 4096, 32, 128)],
    "cross_entropy": [(8192, 50257), (4096, 128256)],
    "fused_adamw": [2**26, 2**28],
    "onebit": [2**28],
    "moe": [(16384, 4096, 64, 2)],
}
DRY_SIZES = {
    "norm": [(5, 33)], "glu": [(3, 40)], "rope": [(1, 5, 2, 8)], "cross_entropy": [(3, 50257)],
    "fused_adamw": [1000], "onebit": [1000], "moe": [(9, 16, 4, 2)],
}  # fmt: skip


def cases(sizes: dict, div: int) -> list[tuple[str, str, str, Callable]]:
    out = []
    for mode in ("fwd", "fwd+bwd"):
        for kind in ("rms_norm", "layer_norm"):
            for rows, n in sizes["norm"]:
                out.append((kind, f"{rows // div}x{n}", mode, lambda k=kind, r=rows // div, n=n, m=mode: case_norm(k, r, n, m)))
        for kind in ("swiglu", "geglu"):
            for rows, n in sizes["glu"]:
                out.append((kind, f"{rows // div}x{n}", mode, lambda k=kind, r=rows // div, n=n, m=mode: case_glu(k, r, n, m)))
        for b, seq, h, dim in sizes["rope"]:
            out.append(("rope", f"{b}x{seq // div}x{h}x{dim}", mode, lambda b=b, s=seq // div, h=h, d=dim, m=mode: case_rope(b, s, h, d, m)))
    for rows, vocab in sizes["cross_entropy"]:
        r = max(1, rows // div)
        out.append(("cross_entropy", f"{r}x{vocab}", "fwd+bwd", lambda r=r, v=vocab: case_cross_entropy(r, v, "fwd+bwd")))
    for numel in sizes["fused_adamw"]:
        out.append(("fused_adamw", str(numel // div), "step", lambda n=numel // div: case_fused_adamw(n, "step")))
    for numel in sizes["onebit"]:
        out.append(("onebit_pack", str(numel // div), "pack+unpack", lambda n=numel // div: case_onebit(n, "")))
    for tokens, d, e, k in sizes["moe"]:
        t = max(1, tokens // div)
        out.append(("moe_permute", f"{t}x{d},E{e},k{k}", "fwd+bwd", lambda t=t, d=d, e=e, k=k: case_moe(t, d, e, k, "")))
    return out


def dry_run() -> int:
    """Run every case once on the CPU with tiny sizes (Triton interpreted, no torch.compile, no timing):
    checks the script itself where no GPU is available."""
    for op, size, mode, make in cases(DRY_SIZES, 1):
        fns = make()[0]
        for impl, fn in fns.items():
            if impl != "compile":
                fn()
                print(json.dumps({"op": op, "size": size, "mode": mode, "impl": impl, "dry_run": "ok"}), flush=True)
    return 0


def check_targets(copy_gbps: float, out) -> None:
    def get(op: str, impl: str, key: str) -> list[tuple[str, float]]:
        return [(r["size"], r[key]) for r in RESULTS if r.get("op") == op and r.get("impl") == impl and key in r]

    for size, gbps in get("fused_adamw", "triton", "gbps"):
        emit({"target": "fused_adamw >= 80% of copy bandwidth", "size": size,
              "value": round(gbps / copy_gbps, 3), "pass": gbps >= 0.8 * copy_gbps}, out)  # fmt: skip
    for base in ("torch", "torch_F_bf16"):
        ms_base, mem_base = dict(get("cross_entropy", base, "ms")), dict(get("cross_entropy", base, "peak_mb"))
        for size, ms in get("cross_entropy", "triton", "ms"):
            mem = dict(get("cross_entropy", "triton", "peak_mb")).get(size)
            if size in ms_base and mem and size in mem_base:
                emit({"target": f"cross_entropy >= 2x faster and >= 2x less memory than {base}", "size": size,
                      "speedup": round(ms_base[size] / ms, 2), "memory_ratio": round(mem_base[size] / mem, 2),
                      "pass": ms_base[size] / ms >= 2 and mem_base[size] / mem >= 2}, out)  # fmt: skip
    for op in ("rms_norm", "layer_norm", "swiglu", "geglu"):
        compiled = {(r["size"], r["mode"]): r["ms"] for r in RESULTS if r.get("op") == op and r.get("impl") == "compile" and "ms" in r}
        for r in RESULTS:
            if r.get("op") == op and r.get("impl") == "triton" and (r["size"], r["mode"]) in compiled:
                c = compiled[(r["size"], r["mode"])]
                emit({"target": f"{op} no slower than torch.compile", "size": r["size"], "mode": r["mode"],
                      "ratio": round(c / r["ms"], 3), "pass": r["ms"] <= c}, out)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes divided by 4 (a smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU, Triton interpreted")
    args = parser.parse_args()
    if args.dry_run:
        global DEV
        DEV = "cpu"
        os.environ["TRITON_INTERPRET"] = "1"  # before the first Triton module is imported (lazily)
        return dry_run()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device; kernel benchmarks need a GPU"}))
        return 0
    out = args.out.open("a") if args.out else None
    emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__}, out)
    copy_gbps = copy_bandwidth()
    emit({"op": "copy", "gbps": round(copy_gbps, 1)}, out)
    for op, size, mode, make in cases(SIZES, 4 if args.quick else 1):
        try:
            fns, nbytes, grads, measure_memory = make()
        except Exception as e:  # best-effort sweep: report the case and go on
            emit({"op": op, "size": size, "mode": mode, "error": f"setup: {type(e).__name__}: {e}"[:300]}, out)
            continue
        for impl, fn in fns.items():
            try:
                ms = time_ms(fn, grads)
                record = {"op": op, "size": size, "mode": mode, "impl": impl, "ms": round(ms, 4),
                          "gbps": round(nbytes / ms / 1e6, 1)}  # fmt: skip
                if measure_memory:
                    for g in grads:
                        g.grad = None
                    record["peak_mb"] = round(peak_bytes(fn) / 2**20, 1)
            except Exception as e:  # best-effort sweep: e.g. torch.compile failing on one case
                record = {"op": op, "size": size, "mode": mode, "impl": impl, "error": f"{type(e).__name__}: {e}"[:300]}
            emit(record, out)
        del fns
        torch.cuda.empty_cache()
    check_targets(copy_gbps, out)
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
