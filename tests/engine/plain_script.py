"""A plain DeepSpeed-style training script with no logging set up, run as a subprocess by the tests of
the progress line (tests/engine/test_progress.py) and of heartbeats from script jobs
(tests/worker/test_heartbeat.py): `python plain_script.py STEPS [STEPS_PER_PRINT]`."""

from __future__ import annotations

import sys

import torch

import deepfleet.engine as deepspeed


def main() -> None:
    steps = int(sys.argv[1])
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    if len(sys.argv) > 2:
        config["steps_per_print"] = int(sys.argv[2])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Flatten(), torch.nn.Linear(8 * 6, 1))
    engine, *_ = deepspeed.initialize(model=model, config=config)
    ids = torch.randint(0, 32, (4, 6))
    target = torch.randn(4, 1)
    while engine.global_steps < steps:
        loss = torch.nn.functional.mse_loss(engine(ids), target)
        engine.backward(loss)
        engine.step()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
