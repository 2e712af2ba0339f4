"""One autotuning trial: train the factory's model for a few steps with one experiment's config and
write the measured metric. Run by `engine/planner/tune.py` on every rank of the trial, under
torchrun (`python -m torch.distributed.run ... -m deepfleet.engine.planner.trial EXP.json`), so a
trial that fails or runs out of memory ends only its own processes.

EXP.json: {"config": ds_config, "model": "pkg.mod:function", "model_args": {...},
"start_profile_step": s, "end_profile_step": e, "metric_path": path}. Steps 1..e run; steps s..e are
timed (each an optimizer step of gradient_accumulation_steps micro-steps). Rank 0 writes
{"throughput": tokens/s, "latency": s per step, "flops": 6 x params x tokens/s, "samples_per_s",
"peak_model_state_bytes"} to metric_path, written to a temporary name and renamed, so a killed trial
leaves no metric behind. `measure` is the same trial on the caller's process group: the managed
training loop tunes a job in-process with it (`tune.inprocess_runner`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepfleet.engine.planner.profile import Built, build, resolve_factory


def _tokens(batch: Any, samples: int) -> int:
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    return int(ids.numel()) if isinstance(ids, torch.Tensor) else samples


def run(exp: dict[str, Any]) -> dict[str, Any] | None:
    """Build the experiment's model and measure it (rank 0 gets the metric, other ranks None)."""
    built = build(resolve_factory(exp["model"]), exp.get("model_args") or {}, device="cpu")
    metric = measure(built, exp["config"], start=int(exp["start_profile_step"]), end=int(exp["end_profile_step"]))
    return metric if dist.get_rank() == 0 else None


def measure(built: Built, config: dict[str, Any], *, start: int, end: int) -> dict[str, Any]:
    """Train `built` with `config` for steps 1..end on the current process group, timing start..end.
    Every rank returns the same metric (times are the slowest rank's), so ranks that tune in-process
    take the same decisions."""
    import deepfleet.engine as deepfleet

    data = built.training_data
    if data is None:
        raise ValueError("the factory gave no training_data; return `model` and `training_data`")
    engine, *_ = deepfleet.initialize(model=built.model, model_parameters=built.model.parameters(),
                                      config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = int(config["train_micro_batch_size_per_gpu"])
    gas = int(config.get("gradient_accumulation_steps", 1))
    collate = built.collate_fn or torch.utils.data.default_collate
    timed = tokens = samples = 0
    t0 = 0.0
    for step in range(1, end + 1):
        if step == start:
            dist.barrier()
            t0 = time.perf_counter()
        for micro_step in range(gas):
            lo = ((step * gas + micro_step) * world + rank) * micro
            batch = collate([data[(lo + i) % len(data)] for i in range(micro)])
            out = engine(batch)
            loss = built.loss_fn(out, batch) if built.loss_fn else out
            engine.backward(loss)
            engine.step()
            if step >= start:
                tokens += _tokens(batch, micro) * world
                samples += micro * world
        if step >= start:
            timed += 1
    stats = torch.tensor([time.perf_counter() - t0, float(engine.peak_model_state_bytes)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    elapsed, peak = float(stats[0]), float(stats[1])
    params = sum(p.numel() for p in built.model.parameters())
    tps = tokens / elapsed
    return {"throughput": tps, "latency": elapsed / timed, "flops": 6.0 * params * tps,
            "samples_per_s": samples / elapsed, "steps_timed": timed, "peak_model_state_bytes": peak}


def main(argv: list[str] | None = None) -> int:
    path = Path((argv or sys.argv[1:])[0])
    exp = json.loads(path.read_text())
    if not dist.is_initialized():
        import datetime

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    try:
        metric = run(exp)
        if metric is not None:
            out = Path(exp["metric_path"])
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_suffix(out.suffix + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(metric))
            tmp.replace(out)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
