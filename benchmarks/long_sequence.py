"""Long-sequence benchmarks on the CPU: block-sparse vs dense attention, and sequence vs data parallelism.

Run: `python benchmarks/long_sequence.py [--quick] [--out results.jsonl]`; prints one JSON line per
measurement and a summary line per target. Every measurement runs in a fresh subprocess, so its peak
memory is that process's own high-water mark (`ru_maxrss`) minus its resident size after building the
inputs; one thread per process (the machine is shared: timings are noisy, ratios of runs interleaved in
the same invocation are the figures to read).

1. `time_memory`: forward + backward time and peak extra memory of `block_sparse_attention` per layout mode
   (fixed, variable, bigbird, bslongformer, local sliding window; block 64) against dense SDPA (torch's CPU
   flash kernel, causal flag, no mask) and dense SDPA given the layout as a mask, at 2k, 8k, 32k tokens
   (dense at 32k: forward only, its backward takes minutes on one core; masked dense stops at 8k; fixed
   stops at 8k: one global block per local window makes its tiles grow quadratically with the length).
2. `budget`: the longest power-of-two length (one head) that sparse BigBird and masked dense SDPA train
   (fwd + bwd) within a fixed memory budget — target: sparse >= 8x the masked dense length. (Unmasked
   flash SDPA is left out: on the CPU its memory is linear in the length; it is bound by time instead.)
3. `speedup`: sparse vs dense SDPA at >= 90% block sparsity (BigBird at 8k/16k tokens) — target >= 4x.
4. `sp_vs_dp`: tokens/s of one training step of an attention layer on 2 gloo ranks, Ulysses sequence
   parallelism (each sequence split over the ranks) vs data parallelism (whole sequences per rank), at
   the same global tokens per step.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("fixed", "variable", "bigbird", "bslongformer", "local")
HEADS, HEAD_DIM, BLOCK = 2, 64, 64


def _layout(mode: str, seq: int, heads: int):
    from deepfleet.engine.attention import sparsity_config as sc

    random.seed(0)
    make = {
        "dense": lambda: sc.DenseSparsityConfig(heads, block=BLOCK),
        "fixed": lambda: sc.FixedSparsityConfig(heads, block=BLOCK, num_local_blocks=4, attention="unidirectional"),
        "variable": lambda: sc.VariableSparsityConfig(heads, block=BLOCK, num_random_blocks=1, local_window_blocks=[4],
                                                      attention="unidirectional"),
        "bigbird": lambda: sc.BigBirdSparsityConfig(heads, block=BLOCK, num_random_blocks=1, attention="unidirectional"),
        "bslongformer": lambda: sc.BSLongformerSparsityConfig(heads, block=BLOCK, attention="unidirectional"),
        "local": lambda: sc.LocalSlidingWindowSparsityConfig(heads, block=BLOCK, attention="unidirectional"),
    }[mode]
    return make().make_layout(seq)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(impl: str, mode: str, seq: int, heads: int, backward: bool) -> dict:
    """One run in this process: {seconds, peak_extra_bytes, density}."""
    import torch
    import torch.nn.functional as F

    from deepfleet.kernels.block_sparse_attention import block_sparse_attention, expand_layout, layout_blocks

    torch.set_num_threads(1)
    if impl == "sparse":  # the custom op's first call pays a one-off setup (~6 s here); keep it out
        w = torch.randn(1, 1, BLOCK, 8, requires_grad=True)
        rw, cw = layout_blocks(torch.ones(1, 1, 1, dtype=torch.int64))
        block_sparse_attention(w, w, w, rw, cw, block=BLOCK).sum().backward()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, HEAD_DIM, requires_grad=backward) for _ in range(3))
    layout = _layout(mode, seq, heads) if mode != "none" else None
    rows, cols = layout_blocks(layout) if layout is not None else (None, None)
    density = float(layout.float().mean()) if layout is not None else 1.0
    base = _rss_bytes()
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        if impl == "sparse":
            out = block_sparse_attention(q, k, v, rows, cols, block=BLOCK, causal=True)
        elif impl == "dense_masked":
            mask = expand_layout(layout, BLOCK, causal=True)  # (H, S, S): the layout in dense form
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:  # dense: SDPA's CPU flash kernel, causal, no mask
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            out.sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_extra_bytes": max(0, peak - base), "density": density}


def run_one(impl: str, mode: str, seq: int, *, heads: int = HEADS, backward: bool = True,
            timeout: float = 900) -> dict:
    cmd = [sys.executable, __file__, "--one", json.dumps([impl, mode, seq, heads, backward])]
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout:.0f}s"}
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def emit(record: dict, out) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")


def time_memory(lengths: list[int], repeats: int, out) -> None:
    for seq in lengths:
        reps = repeats if seq <= 8192 else 1
        runs: dict[tuple[str, str], list[dict]] = {}
        for _ in range(reps):  # interleaved: noise hits every implementation alike
            for mode in MODES:
                if mode == "fixed" and seq > 8192:
                    continue  # its global columns (one per window) grow with the length: GBs of tiles at 32k
                runs.setdefault(("sparse", mode), []).append(run_one("sparse", mode, seq))
                if seq <= 8192:
                    runs.setdefault(("dense_masked", mode), []).append(run_one("dense_masked", mode, seq))
            runs.setdefault(("dense", "none"), []).append(run_one("dense", "none", seq, backward=seq <= 8192))
        dense = _median(runs[("dense", "none")])
        for (impl, mode), rs in runs.items():
            m = _median(rs)
            rec = {"bench": "time_memory", "tokens": seq, "impl": impl, "mode": mode, **m,
                   "backward": not (impl == "dense" and seq > 8192)}
            if impl != "dense" and "seconds" in m and "seconds" in dense and seq <= 8192:
                rec["speedup_vs_dense_sdpa"] = dense["seconds"] / m["seconds"]
            emit(rec, out)


def _median(runs: list[dict]) -> dict:
    ok = [r for r in runs if "seconds" in r]
    if not ok:
        return runs[0]
    return {"seconds": statistics.median(r["seconds"] for r in ok),
            "peak_extra_bytes": statistics.median(r["peak_extra_bytes"] for r in ok), "density": ok[0]["density"]}


def budget(budget_bytes: int, max_len: int, out) -> dict:
    reached = {}
    # SDPA's CPU flash kernel without a mask needs memory linear in the length (it is time-bound, not
    # memory-bound); the dense form of a sparse layout is SDPA with the layout as a mask.
    for impl, mode in (("dense_masked", "bigbird"), ("sparse", "bigbird")):
        seq, best = 1024, 0
        while seq <= max_len:
            r = run_one(impl, mode, seq, heads=1)
            ok = "seconds" in r and r["peak_extra_bytes"] <= budget_bytes
            emit({"bench": "budget", "impl": impl, "mode": mode, "tokens": seq, "within_budget": ok, **r}, out)
            if not ok:
                break
            best, seq = seq, seq * 2
        reached[impl] = best
    ratio = reached["sparse"] / max(reached["dense_masked"], 1)
    emit({"bench": "budget", "summary": True, "budget_bytes": budget_bytes, "longest": reached,
          "sparse_over_masked_dense": ratio, "target": ">= 8x", "met": ratio >= 8,
          "capped_at": max_len}, out)
    return reached


def speedup(lengths: list[int], repeats: int, out) -> None:
    for seq in lengths:
        sparse, dense = [], []
        for _ in range(repeats):
            sparse.append(run_one("sparse", "bigbird", seq))
            dense.append(run_one("dense", "none", seq))
        s, d = _median(sparse), _median(dense)
        ratio = d["seconds"] / s["seconds"]
        emit({"bench": "speedup", "tokens": seq, "mode": "bigbird", "block_sparsity": 1 - s["density"],
              "sparse_seconds": s["seconds"], "dense_sdpa_seconds": d["seconds"], "speedup": ratio,
              "target": ">= 4x at >= 90% sparsity", "met": ratio >= 4 and s["density"] <= 0.1}, out)


def _sp_dp_rank(rank: int, world: int, mode: str, seq: int, steps: int) -> float:
    import torch
    import torch.nn.functional as F

    import deepfleet.engine as deepspeed
    from deepfleet.engine.attention.data import shard_sequence
    from deepfleet.engine.attention.ulysses import ulysses_attention

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.qkv, self.proj, self.group = torch.nn.Linear(256, 768), torch.nn.Linear(256, 256), None

        def forward(self, x):  # (B, s, 256)
            q, k, v = (t.reshape(*x.shape[:2], 4, 64) for t in self.qkv(x).chunk(3, -1))

            def attn(a, b, c):
                return F.scaled_dot_product_attention(a, b, c, is_causal=True)
            if self.group is None:
                o = attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
            else:
                o = ulysses_attention(q, k, v, attn, group=self.group)
            return self.proj(o.reshape(x.shape)).square().mean()

    model = Layer()
    sp = world if mode == "sp" else 1
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config={"train_micro_batch_size_per_gpu": world if sp > 1 else 1,
                                              "sequence_parallel_size": sp, "optimizer": {"type": "AdamW"}})
    if sp > 1:
        model.group = engine.parallel.submesh("sp").get_group()
    torch.manual_seed(1)
    batch = torch.randn(world, seq, 256)  # the same global tokens either way: world sequences of seq
    local = shard_sequence(batch, rank=rank, world=world) if sp > 1 else batch[rank:rank + 1]
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        engine.backward(engine(local))
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def sp_vs_dp(seq: int, steps: int, repeats: int, out) -> None:
    from tests.spawn import spawn

    res: dict[str, list[float]] = {"sp": [], "dp": []}
    for _ in range(repeats):
        for mode in ("dp", "sp"):
            res[mode].append(max(spawn(_sp_dp_rank, 2, mode, seq, steps, timeout=900)))
    tokens = 2 * seq
    tps = {m: tokens / statistics.median(v) for m, v in res.items()}
    emit({"bench": "sp_vs_dp", "ranks": 2, "tokens_per_step": tokens, "seq_len": seq,
          "tokens_per_s": tps, "sp_over_dp": tps["sp"] / tps["dp"]}, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small lengths, one repeat (a smoke run)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", choices=("time_memory", "budget", "speedup", "sp_vs_dp"))
    parser.add_argument("--budget-gib", type=float, default=2.0)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        impl, mode, seq, heads, backward = json.loads(args.one)
        print(json.dumps(measure(impl, mode, seq, heads, backward)))
        return
    out = args.out.open("w") if args.out else None
    lengths = [1024, 2048] if args.quick else [2048, 8192, 32768]
    repeats = 1 if args.quick else 3
    if args.only in (None, "time_memory"):
        time_memory(lengths, repeats, out)
    if args.only in (None, "budget"):
        budget(int(args.budget_gib * 2**30) if not args.quick else 2**28, 8192 if args.quick else 262144, out)
    if args.only in (None, "speedup"):
        speedup([2048] if args.quick else [8192, 16384], repeats, out)
    if args.only in (None, "sp_vs_dp"):
        sp_vs_dp(1024 if args.quick else 4096, 2 if args.quick else 3, 1 if args.quick else 3, out)


if __name__ == "__main__":
    main()
