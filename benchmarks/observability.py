"""Overhead of observability on the engine's step time: the FLOPs profiler (MFU per step after its
profiled step), the comms logger, the wall-clock breakdown and every monitor (tensorboard, csv_monitor,
wandb offline, mlflow on a local SQLite store) against the same engine with all of them off.

Run alone: `python benchmarks/observability.py [--steps 40]` (one process, one thread, the example
GPT). Two engines train side by side in one process, one step each in turn (interleaved, so machine
noise hits both alike); the profiled step (FlopCounterMode, once per run) and warm-up steps are left
out and its cost is printed on its own. Prints the median (and min) step seconds of each, the overhead ratio
of the medians and the median of the per-step paired ratios (target < 2%), and the wall-clock breakdown table of the observed engine training alone
for as many steps again. Output files go to a temporary
folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import deepfleet.engine as deepspeed  # noqa: E402
from deepfleet.engine.profiling.breakdown import WallClockBreakdown  # noqa: E402
from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens  # noqa: E402

WARMUP = 3


def build(config: dict):
    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig())
    engine, _, loader, _ = deepspeed.initialize(
        model=model, training_data=SyntheticTokens(num_samples=100_000), config={
            "train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            **config})
    return engine, iter(loader)


def one_step(engine, batches) -> float:
    start = time.perf_counter()
    engine.backward(engine(next(batches)))
    engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="measured steps per engine")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    out = Path(tempfile.mkdtemp(prefix="deepfleet-obs-"))
    os.chdir(out)
    os.environ.setdefault("WANDB_MODE", "offline")
    plain, plain_batches = build({})
    observed, observed_batches = build({
        "steps_per_print": 10_000, "wall_clock_breakdown": True,
        "flops_profiler": {"enabled": True, "profile_step": WARMUP, "output_file": str(out / "flops.txt")},
        "comms_logger": {"enabled": True},
        "tensorboard": {"enabled": True, "output_path": str(out / "tb")},
        "csv_monitor": {"enabled": True, "output_path": str(out / "csv")},
        "wandb": {"enabled": True, "project": "deepfleet-bench"},
        "mlflow": {"enabled": True, "tracking_uri": f"sqlite:///{out / 'mlruns.db'}"},
    })
    times: dict[str, list[float]] = {"plain": [], "observed": []}
    profiled = None
    for i in range(WARMUP + args.steps):
        if i % 2:  # alternate which engine goes first, so neither always runs on the other's warm caches
            t_observed = one_step(observed, observed_batches)
            t_plain = one_step(plain, plain_batches)
        else:
            t_plain = one_step(plain, plain_batches)
            t_observed = one_step(observed, observed_batches)
        if i + 1 == WARMUP:
            profiled = t_observed
        if i >= WARMUP:
            times["plain"].append(t_plain)
            times["observed"].append(t_observed)
    # The breakdown of the observed engine alone (interleaved, its "data loading" would hold the other
    # engine's steps): a fresh one over `--steps` more steps.
    breakdown = WallClockBreakdown(steps_per_print=None, rank=0)
    observed.sinks.append(breakdown)
    alone = [one_step(observed, observed_batches) for _ in range(args.steps)]
    table = breakdown.table()
    plain.destroy()
    observed.destroy()
    p, o = statistics.median(times["plain"]), statistics.median(times["observed"])
    print(json.dumps({
        "steps": args.steps, "plain_median_s": round(p, 6), "observed_median_s": round(o, 6),
        "overhead": round(o / p - 1, 4),
        "paired_overhead": round(statistics.median(b / a for a, b in zip(times["plain"], times["observed"],
                                                                            strict=True)) - 1, 4), "profiled_step_s": round(profiled or 0.0, 4),
        "min_plain_s": round(min(times["plain"]), 6), "min_observed_s": round(min(times["observed"]), 6),
        "alone_median_s": round(statistics.median(alone), 6),
        "threads": torch.get_num_threads(), "output": str(out),
    }))
    print(f"wall-clock breakdown of the observed engine alone over {args.steps} steps:")
    print(table)


if __name__ == "__main__":
    main()
