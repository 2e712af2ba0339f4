"""Pipeline benchmark: the tiny GPT (`examples/gpt/model.py`) as a layer list, 2 pipeline stages on 2 gloo
ranks, on deepfleet's PipelineModule with each schedule and on DeepSpeed 0.19.8's PipelineModule (its own
1F1B, from its own virtual environment); same layers, data, config (fp32, torch AdamW, ZeRO-0, clipping).

One rank group per run (torchrun); rank 0 prints one JSON line: `{"impl", "schedule", "step_time_median_s",
"tokens_per_s", "state_bytes_per_stage", "max_rss_mb_per_stage", "losses"}`. `--impl sequential` runs the
same model and global batch in one process (pp 1): its step time over the stage count is the bubble-free
pipeline step, so a schedule's measured bubble is `1 - (t_seq / pp) / t_step`, printed beside the
analytical fraction (engine/pipe/schedule.py's `bubble_fraction`). `--compare` runs everything
interleaved, `--repeats` times, and prints medians and ratios (timing on a shared machine is noisy; the
ratios of interleaved runs are the figures). `--bf16` trains both engines in bf16 (`bf16.enabled`);
`--partition` picks the partition method, and `profile` (deepfleet's measured per-layer time) runs
DeepSpeed with `parameters`, which it has instead.

Usage: python benchmarks/pipeline.py --compare [--repeats 3]
       torchrun --standalone --nproc-per-node 2 benchmarks/pipeline.py --impl deepfleet --schedule 1F1B
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
VENV = ROOT / ".venv"
DS_VENV = Path(os.environ.get("DEEPSPEED_VENV", ROOT / ".venv-deepspeed"))
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBV")


def bench_config(args: argparse.Namespace, schedule: str | None) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
    }
    if args.bf16:
        cfg["bf16"] = {"enabled": True}
    if schedule is not None:
        cfg["pipeline"] = {"schedule": schedule}
    return cfg


def gpt_layers(args: argparse.Namespace) -> list:
    """The tiny GPT as a list of layers: embeddings, blocks, final norm and head (each a module)."""
    import torch
    from torch import nn

    from examples.gpt.model import Block, GPTConfig

    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_heads=4, n_layers=args.layers)

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (batch, seq) -> (batch, seq, d_model)
            return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # -> (batch, seq, vocab)
            return self.head(self.ln_f(x))

    torch.manual_seed(0)
    return [Embed(), *[Block(cfg) for _ in range(cfg.n_layers)], Head()]


def loss_fn(logits, labels):  # noqa: ANN001, ANN201 - shared by both engines
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.impl == "deepspeed":
        import deepspeed
        from deepspeed.pipe import PipelineModule

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        import deepfleet.engine as deepspeed
        from deepfleet.engine.pipe import PipelineModule

        deepspeed.init_distributed()
    from examples.gpt.model import SyntheticTokens

    world, rank = dist.get_world_size(), dist.get_rank()
    pp = 1 if args.impl == "sequential" else world
    extra = {"schedule": args.schedule} if args.impl == "deepfleet" and args.schedule not in ("GPipe", "1F1B") else {}
    if args.impl == "deepspeed" and args.partition == "profile":
        args.partition = "parameters"  # DeepSpeed's PipelineModule has no measured-time partition
    if args.partition != "parameters":
        extra["partition_method"] = args.partition
        if args.partition == "profile":
            extra["profile_input"] = torch.zeros(args.micro_batch, args.seq, dtype=torch.long)
    model = PipelineModule(gpt_layers(args), num_stages=pp, loss_fn=loss_fn,
                           **{"partition_method": "parameters", **extra})
    schedule = args.schedule if args.impl == "deepfleet" else None
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                           config=bench_config(args, schedule))
    per_step = args.micro_batch * args.micro_batches
    data = SyntheticTokens(num_samples=per_step * (args.steps + args.warmup), seq_len=args.seq,
                           vocab_size=args.vocab, seed=1)
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        micro = []
        for m in range(args.micro_batches):
            lo = step * per_step + m * args.micro_batch
            rows = [data[i] for i in range(lo, lo + args.micro_batch)]
            micro.append((torch.stack([r["input_ids"] for r in rows]), torch.stack([r["labels"] for r in rows])))
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine.train_batch(iter(micro))
        dist.barrier()
        elapsed = time.perf_counter() - t0
        losses.append(round(float(loss), 5))
        if step >= args.warmup:
            times.append(elapsed)
    from benchmarks.zero_stages import reachable_bytes

    mine = {"state_bytes": reachable_bytes(engine),
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        median = statistics.median(times)
        print(json.dumps({
            "bench": "pipeline", "impl": args.impl, "schedule": args.schedule if args.impl == "deepfleet" else "1F1B",
            "stages": pp, "micro_batches": args.micro_batches, "partition": args.partition, "bf16": args.bf16, "step_time_median_s": round(median, 5),
            "tokens_per_s": round(per_step * args.seq / median, 1),
            "state_bytes_per_stage": [g["state_bytes"] for g in gathered],
            "max_rss_mb_per_stage": [round(g["max_rss_mb"], 1) for g in gathered], "losses": losses,
        }), flush=True)
    dist.destroy_process_group()


def run_one(impl: str, schedule: str, extra: list[str]) -> dict | None:
    python = DS_VENV / "bin" / "python" if impl == "deepspeed" else VENV / "bin" / "python"
    if not python.exists():
        return None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    nproc = "1" if impl == "sequential" else "2"
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nproc,
           str(ROOT / "benchmarks" / "pipeline.py"), "--impl", impl, "--schedule", schedule, *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"bench": "pipeline"')]
    if proc.returncode or not lines:
        print(f"{impl} {schedule}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1])


def compare(args: argparse.Namespace, extra: list[str]) -> None:
    from deepfleet.engine.pipe.schedule import bubble_fraction

    runs: dict[tuple[str, str], list[dict]] = {("sequential", "1F1B"): [], ("deepspeed", "1F1B"): []}
    for schedule in SCHEDULES:
        runs[("deepfleet", schedule)] = []
    for _ in range(args.repeats):
        for (impl, schedule), results in runs.items():  # interleaved: a noisy neighbour hits every run alike
            result = run_one(impl, schedule, extra)
            if result is not None:
                results.append(result)
    med = {key: statistics.median(r["step_time_median_s"] for r in rs) for key, rs in runs.items() if rs}
    seq = med.get(("sequential", "1F1B"))
    for key, rs in runs.items():
        if not rs:
            continue
        impl, schedule = key
        line = {"impl": impl, "schedule": schedule, "step_time_median_s": med[key],
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "state_bytes_per_stage": rs[-1]["state_bytes_per_stage"],
                "max_rss_mb_per_stage": rs[-1]["max_rss_mb_per_stage"], "losses": rs[-1]["losses"]}
        if impl != "sequential" and seq is not None:
            chunks = 2 if schedule in ("Interleaved1F1B", "ZBV") else 1
            line["bubble_measured"] = round(1 - (seq / 2) / med[key], 3)
            line["bubble_analytical"] = round(bubble_fraction(schedule if impl == "deepfleet" else "1F1B", stages=2,
                                                              micro_batches=args.micro_batches, chunks=chunks), 3)
        print(json.dumps(line))
    ds = med.get(("deepspeed", "1F1B"))
    if ds is not None:
        for schedule in SCHEDULES:
            if ("deepfleet", schedule) in med:
                print(f"tokens/s deepfleet {schedule} / DeepSpeed 1F1B: {ds / med[('deepfleet', schedule)]:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", choices=["deepfleet", "deepspeed", "sequential"])
    ap.add_argument("--schedule", choices=SCHEDULES, default="1F1B")
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--bf16", action="store_true", help="bf16 training (`bf16.enabled`) on both engines")
    ap.add_argument("--partition", default="parameters",
                    help="partition_method (parameters, uniform, type:<regex>; profile: deepfleet's measured per-layer "
                    "time, which DeepSpeed lacks, so --compare runs DeepSpeed with parameters)")
    args = ap.parse_args()
    if args.compare:
        skip = {"--compare"}
        forwarded, it = [], iter(sys.argv[1:])
        for a in it:
            if a in skip:
                continue
            if a == "--repeats":
                next(it)
                continue
            forwarded.append(a)
        compare(args, forwarded)
    else:
        rank_main(args)


if __name__ == "__main__":
    main()
