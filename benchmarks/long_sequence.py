"""Long-sequence benchmarks on the CPU: block-sparse vs dense attention, and sequence vs data parallelism.

Run: `python benchmarks/long_sequence.py [--quick] [--only SECTION] [--out results.jsonl]`; prints one JSON
line per measurement and a summary line per target. One thread throughout (the machine is shared: timings
are noisy, so the figures to read are ratios of cases timed in interleaved rounds of the same process).
Shapes chosen so that every row, 32k tokens included, runs on a 2-core machine: batch 1, 2 heads, head
dim 64, block 64, causal (unidirectional layouts); one forward + backward per measurement.

1. `time_memory` (with the `speedup` summary): per length (2k, 8k, 32k), the time of dense SDPA (torch's
   CPU flash kernel, causal flag, no mask), `block_sparse_attention` per layout mode (fixed, variable,
   bigbird, bslongformer, local sliding window) and dense SDPA given the layout as a mask (up to 8k: at
   32k its (H, S, S) mask alone is 2 GiB and its scores 8 GiB), as medians of interleaved rounds in one
   process (5 rounds at 2k, 3 at 8k, 1 at 32k); and each case's peak memory, measured in a fork of the
   warmed-up parent (no import or one-off setup in the figure): the resident high-water mark, reset after
   the inputs are built, minus the resident size then (it includes the inputs' gradients and ~15-20 MB
   that every case shows at small lengths: allocator pages and first-touch). `speedup`: sparse BigBird
   over dense SDPA at the lengths where its block sparsity is >= 90% (8k, 32k) — target >= 4x.
2. `budget`: the longest power-of-two length (one head) that sparse BigBird and masked dense SDPA train
   (fwd + bwd) within a fixed memory budget (2 GiB) — target: sparse >= 8x the masked dense length; the
   sparse search stops at 256k tokens (`capped_at`). (Unmasked flash SDPA is left out: on the CPU its
   memory is linear in the length; it is bound by time instead, see the 32k rows.)
3. `sp_vs_dp`: tokens/s of one training step of an attention layer on 2 gloo ranks, Ulysses sequence
   parallelism (each sequence split over the ranks) vs data parallelism (whole sequences per rank), at
   the same global tokens per step.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import select
import signal
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("fixed", "variable", "bigbird", "bslongformer", "local")
HEADS, HEAD_DIM, BLOCK = 2, 64, 64
MASKED_DENSE_MAX = 8192


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


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _prepare(impl: str, mode: str, seq: int, heads: int, backward: bool):
    """Inputs and a zero-argument call that runs one forward (+ backward) of `impl`; and the density."""
    import torch
    import torch.nn.functional as F

    from deepfleet.kernels.block_sparse_attention import block_sparse_attention, expand_layout, layout_blocks

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, HEAD_DIM, requires_grad=backward) for _ in range(3))
    layout = _layout(mode, seq, heads) if mode != "none" else None
    rows, cols = layout_blocks(layout) if layout is not None else (None, None)
    density = float(layout.float().mean()) if layout is not None else 1.0

    def call() -> None:
        for t in (q, k, v):
            t.grad = None
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

    return call, density


def _warm_up() -> None:
    """Run every implementation once at a small length: the custom op's one-off setup (~2 s here) and the
    first page-in of each kernel's code stay out of every figure (forked measurements inherit them)."""
    import torch

    torch.set_num_threads(1)
    for impl, mode in (("sparse", "bigbird"), ("dense_masked", "bigbird"), ("dense", "none")):
        _prepare(impl, mode, 4 * BLOCK, HEADS, True)[0]()


def measure(impl: str, mode: str, seq: int, heads: int, backward: bool) -> dict:
    """One run in this (forked) process: {seconds, peak_extra_bytes, density}. The peak is the resident
    high-water mark (reset after the inputs are built) minus the resident size then."""
    call, density = _prepare(impl, mode, seq, heads, backward)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    base = _status_kib("VmRSS")
    start = time.perf_counter()
    call()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_extra_bytes": max(0, _status_kib("VmHWM") - base) * 1024, "density": density}


def timing(cases: list[list], seq: int, rounds: int) -> dict:
    """Interleaved rounds in this one process: every case once per round, median seconds per case."""
    calls = [(_prepare(impl, mode, seq, HEADS, backward)[0]) for impl, mode, backward in cases]
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(rounds):  # interleaved: load changes hit every implementation alike
        for i, call in enumerate(calls):
            start = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - start)
    return {f"{impl}/{mode}": statistics.median(t) for (impl, mode, _), t in zip(cases, times, strict=True)}


def _forked(fn, *args, timeout: float) -> dict:
    """Run fn(*args) -> dict in a fork of this warmed-up process (its own memory high-water mark, no import
    or warm-up cost); an error or a timeout comes back as {"error": ...}."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so the child does not reuse it unseen
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one thread (forking is safe with torch's pool at one thread)
        os.close(read_fd)
        try:
            result = fn(*args)
        except BaseException as e:  # report every failure to the parent
            result = {"error": f"{type(e).__name__}: {e}"[:200]}
        with os.fdopen(write_fd, "w") as w:
            w.write(json.dumps(result))
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as r:
        ready, _, _ = select.select([r], [], [], timeout)
        text = r.read() if ready else ""
    if not ready:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if not text:
        return {"error": f"timeout {timeout:.0f}s" if not ready else f"child died (status {status})"}
    return json.loads(text)


def run_one(impl: str, mode: str, seq: int, *, heads: int = HEADS, backward: bool = True,
            timeout: float = 900) -> dict:
    return _forked(measure, impl, mode, seq, heads, backward, timeout=timeout)


def emit(record: dict, out) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")


def _masked_dense_fits(seq: int) -> bool:
    return seq <= MASKED_DENSE_MAX  # its (H, S, S) mask and scores: 8 GB and more at 32k


def time_memory(lengths: list[int], rounds_at: dict[int, int], out) -> list[dict]:
    """Per length: time (interleaved rounds in one process) and peak memory (a fresh process each)."""
    rows = []
    for seq in lengths:
        cases = [["dense", "none", True]] + [["sparse", m, True] for m in MODES]
        cases += [["dense_masked", m, True] for m in MODES if _masked_dense_fits(seq)]
        times = _forked(timing, cases, seq, rounds_at.get(seq, 1), timeout=3600)
        dense_s = times.get("dense/none")
        for impl, mode, _ in cases:
            mem = run_one(impl, mode, seq)
            rec = {"bench": "time_memory", "tokens": seq, "heads": HEADS, "head_dim": HEAD_DIM, "block": BLOCK,
                   "impl": impl, "mode": mode, "backward": True, "seconds": times.get(f"{impl}/{mode}"),
                   "peak_extra_bytes": mem.get("peak_extra_bytes"), "density": mem.get("density"),
                   "rounds": rounds_at.get(seq, 1)}
            if "error" in times or "error" in mem:
                rec["error"] = times.get("error") or mem.get("error")
            if impl != "dense" and rec["seconds"] and dense_s:
                rec["speedup_vs_dense_sdpa"] = dense_s / rec["seconds"]
            emit(rec, out)
            rows.append(rec)
        for mode in MODES:
            if not _masked_dense_fits(seq):
                emit({"bench": "time_memory", "tokens": seq, "impl": "dense_masked", "mode": mode,
                      "skipped": f"its (H, S, S) mask alone is {HEADS * seq * seq / 2**30:.0f} GiB"}, out)
    return rows


def budget(budget_bytes: int, start: int, max_len: int, out) -> dict:
    reached = {}
    # SDPA's CPU flash kernel without a mask needs memory linear in the length (it is time-bound, not
    # memory-bound); the dense form of a sparse layout is SDPA with the layout as a mask.
    for impl, mode in (("dense_masked", "bigbird"), ("sparse", "bigbird")):
        seq, best = start, 0
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
          "capped_at": max_len, "sparse_capped": reached["sparse"] == max_len}, out)
    return reached


def speedup(rows: list[dict], out) -> None:
    """The speedup of sparse BigBird over dense SDPA at the lengths where its block sparsity is >= 90%."""
    for rec in rows:
        if rec["impl"] == "sparse" and rec["mode"] == "bigbird" and rec.get("speedup_vs_dense_sdpa"):
            sparsity = 1 - rec["density"]
            emit({"bench": "speedup", "tokens": rec["tokens"], "mode": "bigbird", "block_sparsity": sparsity,
                  "speedup": rec["speedup_vs_dense_sdpa"], "target": ">= 4x at >= 90% sparsity",
                  "counts": sparsity >= 0.9, "met": rec["speedup_vs_dense_sdpa"] >= 4 and sparsity >= 0.9}, out)


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
    parser.add_argument("--quick", action="store_true", help="small lengths, one round (a smoke run)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", choices=("time_memory", "budget", "sp_vs_dp"))
    parser.add_argument("--budget-gib", type=float, default=2.0)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported: one thread, and forks stay safe
    _warm_up()
    out = args.out.open("w") if args.out else None
    lengths = [1024, 2048] if args.quick else [2048, 8192, 32768]
    rounds_at = {} if args.quick else {2048: 5, 8192: 3, 32768: 1}
    if args.only in (None, "time_memory"):
        speedup(time_memory(lengths, rounds_at, out), out)
    if args.only in (None, "budget"):
        if args.quick:
            budget(2**28, 1024, 8192, out)
        else:
            budget(int(args.budget_gib * 2**30), 2048, 262144, out)
    if args.only in (None, "sp_vs_dp"):
        sp_vs_dp(1024 if args.quick else 4096, 2 if args.quick else 3, 1 if args.quick else 3, out)


if __name__ == "__main__":
    main()
