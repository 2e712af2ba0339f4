"""Checkpoint cost on the example model: save/load time and bytes per ZeRO stage, and async save's stall.

Run by `make bench` (benchmarks/run_all.py) or alone:
    .venv/bin/python benchmarks/checkpoint.py [--stages 0 1 2 3] [--d-model 256] [--layers 4] [--repeats 3]
For each stage it launches 2 gloo ranks under torchrun; rank 0 prints two JSON lines:
- `checkpoint_save_load`: median wall time of a synchronous `engine.save_checkpoint` (DCP write,
  per-rank sha256, manifest, COMPLETE) and of `engine.load_checkpoint` (checksum verification, shape
  check, DCP read and reshard), and the checkpoint's bytes on disk;
- `checkpoint_async_stall`: how long the training loop stops for a save. The stall is the wall time of
  a training step with a save attached minus the median plain step: a synchronous save versus
  `async_save=True` (which returns once the tensors are staged in memory), plus the async save's time
  until COMPLETE is written (training continues meanwhile).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORLD = 2


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    import deepfleet.engine as deepfleet
    from deepfleet.engine.checkpoint.api import wait_for_checkpoint
    from deepfleet.engine.checkpoint.manifest import read_manifest
    from examples.gpt.model import GPTConfig, GPTWithLoss

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=512, seq_len=64, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    torch.manual_seed(0)
    model = GPTWithLoss(cfg)
    params = sum(p.numel() for p in model.parameters())
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": args.stage},
    }
    engine, *_ = deepfleet.initialize(model=model, config=config)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)

    def step() -> None:
        idx = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len + 1), generator=g)
        loss = engine({"input_ids": idx[:, :-1], "labels": idx[:, 1:]})
        engine.backward(loss)
        engine.step()

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    root = Path(args.root) / f"stage{args.stage}"
    for _ in range(2):  # optimizer state exists from here on
        step()
    saves, loads = [], []
    for i in range(args.repeats):
        saves.append(timed(lambda i=i: engine.save_checkpoint(root, tag=f"sync{i}", keep_last=2)))
        loads.append(timed(lambda i=i: engine.load_checkpoint(root, tag=f"sync{i}")))
    nbytes = read_manifest(root / f"sync{args.repeats - 1}").total_bytes

    plain = [timed(step) for _ in range(args.repeats + 2)]
    sync_stall, async_stall, async_total = [], [], []
    for i in range(args.repeats):
        sync_stall.append(timed(lambda i=i: (step(), engine.save_checkpoint(root, tag=f"s{i}", keep_last=2))))
        start = time.perf_counter()
        async_stall.append(
            timed(lambda i=i: (step(), engine.save_checkpoint(root, tag=f"a{i}", async_save=True, keep_last=2)))
        )
        step()  # training continues while the shards are written
        wait_for_checkpoint(engine)
        async_total.append(time.perf_counter() - start)
    if rank == 0:
        base = statistics.median(plain)
        common = {"stage": args.stage, "world_size": dist.get_world_size(), "params": params}
        print(json.dumps({
            "bench": "checkpoint_save_load", **common,
            "bytes": nbytes,
            "save_s": round(statistics.median(saves), 4),
            "load_s": round(statistics.median(loads), 4),
            "save_mb_per_s": round(nbytes / 1e6 / statistics.median(saves), 1),
        }), flush=True)
        print(json.dumps({
            "bench": "checkpoint_async_stall", **common,
            "step_s": round(base, 4),
            "sync_stall_s": round(statistics.median(sync_stall) - base, 4),
            "async_stall_s": round(statistics.median(async_stall) - base, 4),
            "async_until_complete_s": round(statistics.median(async_total), 4),
            "stall_ratio_async_over_sync": round(
                (statistics.median(async_stall) - base) / max(statistics.median(sync_stall) - base, 1e-9), 3
            ),
        }), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--root", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    with tempfile.TemporaryDirectory(prefix="deepfleet-ckpt-bench-") as root:
        for stage in args.stages:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
                   __file__, "--worker", "--stage", str(stage), "--root", root, "--d-model", str(args.d_model),
                   "--layers", str(args.layers), "--repeats", str(args.repeats)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                print(json.dumps({"bench": "checkpoint", "stage": stage, "error": proc.stderr[-2000:]}), flush=True)
                continue
            for line in lines:
                print(line, flush=True)


if __name__ == "__main__":
    main()
