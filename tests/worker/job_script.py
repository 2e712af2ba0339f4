"""A user's training script as a deepfleet job runs it: it passes no config to `initialize` (the job's
engine config arrives through the worker) and trains the job's step budget (`job_env.max_steps()`).
Run by tests/worker/test_script_jobs.py through the real worker."""

from __future__ import annotations

import torch

import deepfleet.engine as deepspeed
from deepfleet.engine import job_env


def main() -> None:
    steps = job_env.max_steps() or 3
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Flatten(), torch.nn.Linear(8 * 6, 1))
    engine, *_ = deepspeed.initialize(model=model)  # config: the job's, from DEEPFLEET_ENGINE_CONFIG
    ids = torch.randint(0, 32, (engine.config.train_micro_batch_size_per_gpu, 6))
    target = torch.randn(ids.shape[0], 1)
    while engine.global_steps < steps:
        loss = torch.nn.functional.mse_loss(engine(ids), target)
        engine.backward(loss)
        engine.step()
    print(f"SCRIPT DONE steps={engine.global_steps} checkpoint_dir={job_env.checkpoint_dir()}", flush=True)


if __name__ == "__main__":
    main()
