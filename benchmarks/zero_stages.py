"""ZeRO stage benchmark: one training script, two engines.

The same DeepSpeed-style loop runs on deepfleet (`import deepfleet.engine as deepspeed`) or on the real
DeepSpeed (`import deepspeed`, from its own virtual environment — it is not a project dependency), on the
same model (`examples/gpt/model.py`), the same deterministic data and the same config. That the loop is
identical is the porting claim; what differs is measured.

One rank group per run (launch with torchrun); rank 0 prints one JSON line:
`{"impl", "stage", "world_size", "params", "bytes_per_rank": [...], "step_time_median_s", "cpu_time_median_s",
"phase_median_s": {"forward", "backward", "step"}, "tokens_per_s", "losses"}`.
Model-state bytes are counted from tensor storages (deduplicated by storage, shards counted locally):
for deepfleet from the strategy's own inventory (`engine.sharding.model_state_tensors()`); for both
engines also as every tensor storage reachable from the engine object (`reachable_bytes`), which
includes communication buffers.

Usage: torchrun --standalone --nproc-per-node 2 benchmarks/zero_stages.py --impl deepfleet --stage 2
`benchmarks/run_all.py` drives the full comparison and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# GPT sizes by parameter count. "27m" is the model of the first ZeRO-3 comparison against DeepSpeed
# (27.4M parameters: 6 blocks of 3.15M, two 4.2M embedding/head matrices).
MODEL_SIZES = {
    "5m": {"d_model": 256, "layers": 4, "vocab": 4096, "seq": 128},
    "27m": {"d_model": 512, "layers": 6, "vocab": 8192, "seq": 128},
}


def bench_config(stage: int, *, micro_batch: int, torch_adam: bool, bf16: bool, overlap_comm: bool | None = None,
                 reduce_bucket_size: float = 5e7) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": reduce_bucket_size, "allgather_bucket_size": 5e7}
    if overlap_comm is not None:  # unset: each engine's default (true at stage 3 only, in both)
        zero["overlap_comm"] = overlap_comm
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                       "torch_adam": torch_adam},
        },
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def reachable_tensors(root: object, *, max_depth: int = 6) -> list:
    """One tensor per distinct storage reachable from `root` through attributes, lists, tuples and dicts
    (parameters, gradients, optimizer state, flat buffers; a DTensor's local shard) — the same walk for
    both engines."""
    import torch

    seen_objs: set[int] = set()
    storages: dict[int, torch.Tensor] = {}

    def visit(obj: object, depth: int) -> None:
        if depth > max_depth or id(obj) in seen_objs:
            return
        seen_objs.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors = [obj]
            if obj.grad is not None:
                tensors.append(obj.grad)
            local = getattr(obj, "_local_tensor", None)  # DTensor: count the local shard
            if local is not None:
                tensors.append(local)
            for t in tensors:
                if t.device.type == "meta" or getattr(t, "_local_tensor", None) is not None:
                    continue
                try:
                    st = t.untyped_storage()
                    if st.nbytes() and st.data_ptr():
                        storages.setdefault(st.data_ptr(), t)
                except (RuntimeError, NotImplementedError):
                    continue  # a freed storage (e.g. FSDP's resharded unsharded params)
            return
        if isinstance(obj, torch.nn.Module):
            for t in obj.parameters():
                visit(t, depth + 1)
            for t in obj.buffers():
                visit(t, depth + 1)
        if isinstance(obj, dict):
            for v in obj.values():
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                visit(v, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            for v in vars(obj).values():
                visit(v, depth + 1)
        if isinstance(obj, torch.optim.Optimizer):
            visit(obj.state, depth + 1)

    visit(root, 0)
    return list(storages.values())


def reachable_bytes(root: object, *, max_depth: int = 6) -> int:
    """Bytes of every distinct tensor storage reachable from `root` (`reachable_tensors`)."""
    return sum(t.untyped_storage().nbytes() for t in reachable_tensors(root, max_depth=max_depth))


def measure(engine: object, impl: str) -> dict:
    out = {"reachable": reachable_bytes(engine)}
    if impl == "deepfleet":
        from deepfleet.engine.memory import strategy_memory

        out.update(strategy_memory(engine.sharding))
    return out


def start_rank(args: argparse.Namespace) -> tuple[object, object, object]:
    """One benchmark rank's start, the same for every engine and benchmark: one thread, the engine
    module of `args.impl` (DeepSpeed or deepfleet under DeepSpeed's name) with its gloo process group,
    and the example GPT built from `args` with seed 0. Returns (engine module, GPTConfig, model)."""
    import torch

    torch.set_num_threads(1)
    if args.impl == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import deepfleet.engine as deepspeed

        deepspeed.init_distributed()
    from examples.gpt.model import GPTConfig, GPTWithLoss

    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layers=args.layers)
    torch.manual_seed(0)
    return deepspeed, cfg, GPTWithLoss(cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=["deepfleet", "deepspeed"], required=True)
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--model-size", choices=sorted(MODEL_SIZES), default="5m",
                    help="a named GPT size; --d-model/--layers/--vocab/--seq override its fields")
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--fused-adam", action="store_true", help="let each engine pick its own AdamW kernel")
    ap.add_argument("--overlap-comm", choices=["default", "true", "false"], default="default",
                    help="zero_optimization.overlap_comm for both engines (default: leave it unset)")
    ap.add_argument("--reduce-bucket-size", type=float, default=5e7,
                    help="zero_optimization.reduce_bucket_size in elements, for both engines")
    ap.add_argument("--profile", action="store_true",
                    help="rank 0 prints torch.profiler's op table over the timed steps to stderr")
    args = ap.parse_args()
    for key, value in MODEL_SIZES[args.model_size].items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    import torch
    import torch.distributed as dist

    from examples.gpt.model import SyntheticTokens

    deepspeed, cfg, model = start_rank(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    n_params = sum(p.numel() for p in model.parameters())
    overlap = {"default": None, "true": True, "false": False}[args.overlap_comm]
    config = bench_config(args.stage, micro_batch=args.micro_batch, torch_adam=not args.fused_adam, bf16=args.bf16,
                          overlap_comm=overlap, reduce_bucket_size=args.reduce_bucket_size)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    data = SyntheticTokens(num_samples=args.micro_batch * world * (args.steps + args.warmup), seq_len=args.seq,
                           vocab_size=args.vocab, seed=1)
    times, cpu_times, losses = [], [], []
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "step": []}
    report: dict = {"bytes": {}}
    last = args.warmup + args.steps - 1
    profiler = None
    for step in range(args.warmup + args.steps):
        if args.profile and step == args.warmup:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        lo = (step * world + rank) * args.micro_batch
        batch = torch.utils.data.default_collate([data[i] for i in range(lo, lo + args.micro_batch)])
        dist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = engine(batch)
        t1 = time.perf_counter()
        engine.backward(loss)
        t2, c2 = time.perf_counter(), time.process_time()
        if step == last:
            # Model states at their peak: after backward (gradients held), with optimizer state allocated.
            report["bytes"] = measure(engine, args.impl)
        t2b, c2b = time.perf_counter(), time.process_time()
        engine.step()
        dist.barrier()
        t3 = time.perf_counter()
        c3 = time.process_time()
        avg = loss.detach().float().clone()
        dist.all_reduce(avg)
        losses.append(round(avg.item() / world, 6))
        if step >= args.warmup:
            times.append(t3 - t0 - (t2b - t2))
            cpu_times.append(c3 - c0 - (c2b - c2))
            phases["forward"].append(t1 - t0)
            phases["backward"].append(t2 - t1)
            phases["step"].append(t3 - t2b)
    if profiler is not None:
        profiler.__exit__(None, None, None)
        if rank == 0:
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30), file=sys.stderr)

    gathered = [None] * world
    dist.all_gather_object(gathered, report["bytes"])
    if rank == 0:
        median = statistics.median(times)
        print(json.dumps({
            "bench": "zero_stage",
            "impl": args.impl,
            "stage": args.stage,
            "world_size": world,
            "params": n_params,
            "bytes_per_rank": gathered,
            "step_time_median_s": round(median, 5),
            # CPU seconds of this process (all its threads, communication included) per step: on a
            # machine shared with other work this tracks what the step costs better than wall time.
            "cpu_time_median_s": round(statistics.median(cpu_times), 5),
            "phase_median_s": {k: round(statistics.median(v), 5) for k, v in phases.items()},
            "tokens_per_s": round(args.micro_batch * world * args.seq / median, 1),
            "losses": losses,
        }), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
