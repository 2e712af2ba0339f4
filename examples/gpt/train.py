"""Train the tiny GPT with a DeepSpeed-style script: porting from DeepSpeed is the import line.

Run it directly, under torchrun, or as a job's script entrypoint under `deepfleet-worker`:

    python examples/gpt/train.py --steps 20
    torchrun --nproc-per-node 2 examples/gpt/train.py --steps 20 --checkpoint-dir /tmp/gpt-ckpt
    deepfleet-worker --spec '{"job_id": "gpt", "processes_per_node": 2,
        "entrypoint": {"script": "examples/gpt/train.py", "args": ["--checkpoint-dir", "/tmp/gpt-ckpt"]}}'

It resumes from the newest complete checkpoint in --checkpoint-dir, and on SIGTERM (or a preemption
notice passed on by the worker) it checkpoints at the next step boundary and exits 75 so the job
resumes where it stopped.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from model import GPTConfig, GPTWithLoss, SyntheticTokens  # examples/gpt/model.py, next to this script

import deepfleet.engine as deepspeed
from deepfleet.worker.signals import PreemptionWatcher, exit_preempted, mark_preempted

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to train to")
    p.add_argument("--config", default=str(HERE / "ds_config.json"), help="DeepSpeed-style engine config")
    p.add_argument("--checkpoint-dir", default=None, help="save/resume here (default: no checkpoints)")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps (and at the end)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    torch.manual_seed(0)  # the same initial weights on every rank
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, seq_len=args.seq_len)
    model = GPTWithLoss(cfg)
    data = SyntheticTokens(num_samples=4096, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
    engine, _, loader, _ = deepspeed.initialize(model=model, config=args.config, training_data=data)
    rank = torch.distributed.get_rank()

    if args.checkpoint_dir:
        path, _ = engine.load_checkpoint(args.checkpoint_dir)
        if path and rank == 0:
            print(f"resumed from {path} at step {engine.global_steps}", flush=True)

    def save() -> None:
        if args.checkpoint_dir:
            engine.save_checkpoint(args.checkpoint_dir)

    watcher = PreemptionWatcher().install()
    start, last_saved = time.perf_counter(), engine.global_steps
    while engine.global_steps < args.steps:
        for batch in loader:  # one epoch, from the saved position
            loss = engine(batch)
            engine.backward(loss)
            before = engine.global_steps
            engine.step()
            if engine.global_steps == before:
                continue  # a micro-step inside the gradient-accumulation window
            step = engine.global_steps
            if rank == 0:
                rate = step / max(time.perf_counter() - start, 1e-9)
                print(f"step {step}/{args.steps} loss {loss.item():.4f} lr {engine.get_lr()[0]:.2e} "
                      f"({rate:.1f} steps/s)", flush=True)
            if step % args.save_every == 0:
                save()
                last_saved = step
            if watcher.should_stop():  # every rank agrees, then one consistent checkpoint
                if last_saved != step:
                    save()
                if rank == 0:
                    mark_preempted(f"global_step{step}")
                torch.distributed.destroy_process_group()
                exit_preempted()
            if step >= args.steps:
                break
    if last_saved != engine.global_steps:
        save()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
