"""MoE benchmark: the small MoE GPT (`examples/gpt/moe_model.py`) on deepfleet's MoE layer, on DeepSpeed
0.19.8's MoE layer (the same model code with `deepspeed.moe.layer.MoE` in its place, run by DeepSpeed's
engine from its own virtual environment), and the dense GPT of equal active parameters on deepfleet;
same data, same config, 2 gloo ranks, expert parallelism over both ranks.

One rank group per run (torchrun); rank 0 prints one JSON line: `{"impl", "tokens_per_s",
"step_time_median_s", "bytes_per_rank", "a2a_share", "losses", ...}`. `a2a_share` is the all-to-all
seconds of a step (deepfleet: its `moe_all_to_all` comm counters; DeepSpeed: its MoE layers' own
first/second all-to-all timers) over the step time. `--compare` runs the three interleaved, `--repeats`
times each, and prints each round, the medians and the ratios, the deepfleet / DeepSpeed ratio also as
the median of the rounds' own ratios (timing on a shared machine is noisy; the ratios of interleaved runs
are the figures).

Usage: python benchmarks/moe.py --compare [--repeats 3] [--stage 2]
       torchrun --standalone --nproc-per-node 2 benchmarks/moe.py --impl deepfleet --stage 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VENV = ROOT / ".venv"
DS_VENV = Path(os.environ.get("DEEPSPEED_VENV", ROOT / ".venv-deepspeed"))


def _shim_deepspeed_moe() -> None:
    """Let `examples/gpt/moe_model.py`'s `from deepfleet.engine.moe.layer import MoE` resolve to
    DeepSpeed's layer in DeepSpeed's environment (where deepfleet is not installed)."""
    import deepspeed.moe.layer as ds_layer

    for name in ("deepfleet", "deepfleet.engine", "deepfleet.engine.moe"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["deepfleet.engine.moe.layer"] = ds_layer


def bench_config(stage: int, *, micro_batch: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7},
        "steps_per_print": 10**9,
    }


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.impl == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        _shim_deepspeed_moe()
    else:
        import deepfleet.engine as deepspeed

        deepspeed.init_distributed()
    from examples.gpt.model import GPTConfig, SyntheticTokens
    from examples.gpt.moe_model import MoEArgs, MoEGPTWithLoss

    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    moe = MoEArgs(num_experts=args.experts, ep_size=world, k=args.k, capacity_factor=args.capacity_factor,
                  min_capacity=4, use_rts=False, moe_every=1)
    torch.manual_seed(0)
    dense_ff = 4 * args.d_model * args.k if args.impl == "dense" else None
    model = MoEGPTWithLoss(cfg, moe, dense_d_ff=dense_ff)
    params = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=bench_config(args.stage, micro_batch=args.micro_batch))
    layers = [m for m in model.modules() if type(m).__name__ == "MOELayer"]
    for layer in layers:  # DeepSpeed times its all-to-alls only when asked
        layer.wall_clock_breakdown = True
    data = SyntheticTokens(num_samples=args.micro_batch * world * (args.steps + args.warmup), seq_len=args.seq,
                           vocab_size=args.vocab, seed=1)
    times, shares, losses = [], [], []
    for step in range(args.warmup + args.steps):
        lo = (step * world + rank) * args.micro_batch
        batch = torch.utils.data.default_collate([data[i] for i in range(lo, lo + args.micro_batch)])
        a2a_before = _a2a_seconds(args.impl, layers)
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(batch)
        engine.backward(loss)
        if step == args.warmup + args.steps - 1:  # model states at their peak: gradients and optimizer state
            t_mem = time.perf_counter()
            mem = _state_bytes(engine)
            t0 += time.perf_counter() - t_mem
        engine.step()
        dist.barrier()
        elapsed = time.perf_counter() - t0
        avg = loss.detach().float().clone()
        dist.all_reduce(avg)
        losses.append(round(avg.item() / world, 5))
        if step >= args.warmup:
            times.append(elapsed)
            shares.append((_a2a_seconds(args.impl, layers) - a2a_before) / elapsed)
    gathered = [None] * world
    dist.all_gather_object(gathered, mem)
    if rank == 0:
        median = statistics.median(times)
        print(json.dumps({
            "bench": "moe", "impl": args.impl, "stage": args.stage, "world_size": world, "params": params,
            "step_time_median_s": round(median, 5),
            "tokens_per_s": round(args.micro_batch * world * args.seq / median, 1),
            "a2a_share": round(statistics.median(shares), 4) if args.impl != "dense" else 0.0,
            "bytes_per_rank": gathered, "losses": losses,
        }), flush=True)
    dist.destroy_process_group()


def _a2a_seconds(impl: str, layers: list) -> float:
    """All-to-all seconds so far on this rank (forward; deepfleet's counters include backward's too)."""
    if impl == "deepspeed":
        # DeepSpeed's timers hold the last forward's first + second all-to-all (milliseconds)
        return sum(getattr(m, "time_falltoall", 0.0) + getattr(m, "time_salltoall", 0.0) for m in layers) / 1e3
    from deepfleet.engine import comm

    c = comm.counters()
    return sum(c[n].seconds for n in ("moe_all_to_all", "moe_all_to_all_counts") if n in c)


def _state_bytes(engine: object) -> int:
    """Bytes of every distinct tensor storage reachable from the engine (params, grads, optimizer state,
    buffers): the same walk for both engines (benchmarks/zero_stages.py)."""
    # Imported as a sibling file: opacus (the privacy extra) installs a top-level `benchmarks` package,
    # which wins over this folder (a namespace package) on `import benchmarks.zero_stages`.
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from zero_stages import reachable_bytes

    return reachable_bytes(engine)


def run_one(impl: str, extra: list[str]) -> dict | None:
    python = DS_VENV / "bin" / "python" if impl == "deepspeed" else VENV / "bin" / "python"
    if not python.exists():
        return None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "moe.py"), "--impl", impl, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"bench": "moe"')]
    if proc.returncode or not lines:
        print(f"{impl}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def compare(args: argparse.Namespace, extra: list[str]) -> None:
    runs: dict[str, list[dict]] = {"deepfleet": [], "deepspeed": [], "dense": []}
    round_ratios: list[float] = []
    for repeat in range(args.repeats):
        this_round: dict[str, float] = {}
        for impl in runs:  # interleaved, so a noisy neighbour hits every engine alike
            result = run_one(impl, extra)
            if result is not None:
                runs[impl].append(result)
                this_round[impl] = result["tokens_per_s"]
        if "deepfleet" in this_round and "deepspeed" in this_round:
            round_ratios.append(this_round["deepfleet"] / this_round["deepspeed"])
        print(json.dumps({"round": repeat, "tokens_per_s": this_round, "load_average": os.getloadavg()[0]}),
              flush=True)
    summary = {}
    for impl, results in runs.items():
        if results:
            summary[impl] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
                "a2a_share": statistics.median(r["a2a_share"] for r in results),
                "bytes_per_rank": results[-1]["bytes_per_rank"], "params": results[-1]["params"],
                "losses": results[-1]["losses"],
            }
            print(json.dumps({"impl": impl, **summary[impl]}))
    if "deepfleet" in summary and "deepspeed" in summary:
        print(f"tokens/s deepfleet / DeepSpeed: {summary['deepfleet']['tokens_per_s'] / summary['deepspeed']['tokens_per_s']:.2f}x"
              f" (ratio of medians); median of the rounds' ratios {statistics.median(round_ratios):.2f}x over "
              f"{len(round_ratios)} rounds ({', '.join(f'{r:.2f}' for r in round_ratios)})")
        print(f"bytes/rank deepfleet / DeepSpeed: "
              f"{max(summary['deepfleet']['bytes_per_rank']) / max(summary['deepspeed']['bytes_per_rank']):.2f}x")
    if "deepfleet" in summary and "dense" in summary:
        print(f"tokens/s MoE / dense (equal active params): "
              f"{summary['deepfleet']['tokens_per_s'] / summary['dense']['tokens_per_s']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=["deepfleet", "deepspeed", "dense"])
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--capacity-factor", type=float, default=1.0)
    args = ap.parse_args()
    if args.compare:
        forwarded = [a for a in sys.argv[1:] if a not in ("--compare",)]
        skip = {"--repeats"}
        extra, it = [], iter(forwarded)
        for a in it:
            if a in skip:
                next(it, None)
                continue
            extra.append(a)
        compare(args, extra)
    else:
        rank_main(args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
