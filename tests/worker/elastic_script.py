"""A tiny plain-torch data-parallel training script with its own DCP checkpoints, run by the worker's
e2e tests as a user script (it needs nothing of the engine). Every step: each rank computes the gradient
of a linear model on its half of a deterministic batch, gradients are all-reduced (AVG), SGD updates,
and a checkpoint `step<N>/` is written with DCP, then `latest` is replaced atomically (after a barrier).
It resumes from `latest`, so an interrupted run ends with the same parameters as an uninterrupted one.

Fault injection (once per run, remembered by a marker file): `--fail-rank R --fail-step S --fail-how
raise|kill|oom|exit3` makes rank R fail at step S. `--step-sleep` slows steps so a test can signal
the worker mid-run. Prints `STEP <n> rank=<r> restart=<k> t=<unix time>` after each completed step.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from deepfleet.worker.signals import PreemptionWatcher, exit_preempted, mark_preempted


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 4, generator=g)  # (global batch, features)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    per = 8 // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _save(root: Path, step: int, model: torch.nn.Module) -> None:
    dcp.save({"model": model.state_dict(), "step": torch.tensor(step)}, checkpoint_id=str(root / f"step{step}"))
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = root / ".latest.tmp"
        tmp.write_text(f"step{step}")
        os.replace(tmp, root / "latest")
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ckpt", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--fail-how", default="raise")
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    args.ckpt.mkdir(parents=True, exist_ok=True)
    start = 0
    if (args.ckpt / "latest").exists():
        state = {"model": model.state_dict(), "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=str(args.ckpt / (args.ckpt / "latest").read_text()))
        model.load_state_dict(state["model"])
        start = int(state["step"])
        print(f"RESUMED step={start} rank={rank} restart={restart}", flush=True)

    watcher = PreemptionWatcher().install()
    marker = args.out / f"failed-{args.fail_rank}-{args.fail_step}"
    for step in range(start + 1, args.steps + 1):
        if rank == args.fail_rank and step == args.fail_step and not marker.exists():
            marker.write_text("1")
            if args.fail_how == "kill":
                print(f"KILL rank={rank} step={step} t={time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fail_how == "oom":
                raise MemoryError("simulated: could not allocate 64 GiB")
            if args.fail_how == "exit3":
                raise SystemExit(3)
            raise ValueError(f"simulated bug at step {step}")
        x, y = _batch(step, rank, world)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for prm in model.parameters():
            dist.all_reduce(prm.grad, op=dist.ReduceOp.AVG)
        opt.step()
        time.sleep(args.step_sleep)
        _save(args.ckpt, step, model)
        print(f"STEP {step} rank={rank} restart={restart} t={time.time():.3f}", flush=True)
        if watcher.should_stop():
            if rank == 0:
                mark_preempted(f"step{step}")
            dist.destroy_process_group()
            exit_preempted()
    if rank == 0:
        flat = torch.cat([q.detach().flatten() for q in model.parameters()])
        (args.out / "final.json").write_text(json.dumps({
            "sha": hashlib.sha256(flat.numpy().tobytes()).hexdigest(), "params": flat.tolist()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
