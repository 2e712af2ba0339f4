"""Step-time overhead of DP-SGD (`deepfleet_differential_privacy`, engine/privacy.py) against plain training on the
example GPT (examples/gpt, its default small size) on 2 gloo ranks, at ZeRO stages 0, 1 and 2.

Both runs train the model as shipped (every parameter, the position embedding included: the example feeds
it batched positions, as DP-SGD's per-sample gradients need), use the same AdamW and batches, and time
`--steps` optimizer steps after `--warmup`. Prints one JSON line per (stage, mode) with the median and fastest step seconds,
then one line per stage with the DP/plain ratios and the epsilon reached at delta = 1e-5. On a shared
machine the fastest step is the steadier figure.

Usage: .venv/bin/python benchmarks/dp_sgd.py [--steps 6] [--warmup 2] [--micro 4] [--stages 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rank(rank: int, world_size: int, stage: int, private: bool, micro: int, steps: int, warmup: int) -> dict:
    import torch

    import deepfleet.engine as deepspeed
    from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPTWithLoss(cfg)
    config = {"train_micro_batch_size_per_gpu": micro, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    data = SyntheticTokens(num_samples=4096, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
    if private:
        config["deepfleet_differential_privacy"] = {"enabled": True, "noise_multiplier": 1.0, "max_grad_norm": 1.0,
                                          "delta": 1e-5, "dataset_size": len(data), "seed": 1}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    times = []
    for step in range(warmup + steps):
        rows = [data[(step * world_size + rank) * micro + i] for i in range(micro)]
        batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}
        start = time.perf_counter()
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    spent = engine.privacy_spent()
    engine.destroy()
    return {"median_step_s": statistics.median(times), "min_step_s": min(times), "loss": float(loss.detach()), "epsilon": spent[0] if spent else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--stages", default="0,1,2")
    args = ap.parse_args()
    from tests.spawn import spawn

    for stage in (int(s) for s in args.stages.split(",")):
        result = {}
        for private in (False, True):
            ranks = spawn(_rank, args.world_size, stage, private, args.micro, args.steps, args.warmup, timeout=900)
            # the slower rank sets the pace
            result[private] = {**ranks[0], "median_step_s": max(r["median_step_s"] for r in ranks),
                               "min_step_s": max(r["min_step_s"] for r in ranks)}
            print(json.dumps({"stage": stage, "mode": "dp_sgd" if private else "plain",
                              "world_size": args.world_size, "micro": args.micro, **result[private]}), flush=True)
        print(json.dumps({"stage": stage,
                          "dp_over_plain_median": result[True]["median_step_s"] / result[False]["median_step_s"],
                          "dp_over_plain_min": result[True]["min_step_s"] / result[False]["min_step_s"],
                          "epsilon_at_1e-5": result[True]["epsilon"], "steps": args.warmup + args.steps}), flush=True)


if __name__ == "__main__":
    main()
