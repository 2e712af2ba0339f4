"""Train the small MoE GPT with a DeepSpeed-style script: experts spread over the ranks (ep_size), any
ZeRO stage, resumable at another ep_size or world size.

    torchrun --nproc-per-node 2 examples/gpt/train_moe.py --steps 20 --ep-size 2
    torchrun --nproc-per-node 2 examples/gpt/train_moe.py --steps 40 --ep-size 1 --checkpoint-dir /tmp/moe-ckpt

The MoE shape comes from the config's `moe` section (`moe_ds_config.json`); `--ep-size` overrides its
ep_size. Each printed step shows the loss, the summed load-balancing loss and the first layer's
tokens per expert.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root: `examples.gpt` imports from any directory

import deepfleet.engine as deepspeed  # noqa: E402
from examples.gpt.model import GPTConfig, SyntheticTokens  # noqa: E402
from examples.gpt.moe_model import MoEArgs, MoEGPTWithLoss  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="optimizer steps to train to")
    p.add_argument("--config", default=str(HERE / "moe_ds_config.json"), help="DeepSpeed-style engine config")
    p.add_argument("--ep-size", type=int, default=None, help="expert-parallel degree (default: the config's)")
    p.add_argument("--checkpoint-dir", default=None, help="save at the end and resume from here")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed()
    config = json.loads(Path(args.config).read_text())
    if args.ep_size is not None:
        config["moe"]["ep_size"] = args.ep_size
    moe = MoEArgs.from_section(config["moe"])
    torch.manual_seed(0)  # the same initial weights on every rank
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers)
    model = MoEGPTWithLoss(cfg, moe)
    data = SyntheticTokens(num_samples=4096, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size)
    engine, _, loader, _ = deepspeed.initialize(model=model, config=config, training_data=data)
    rank = torch.distributed.get_rank()
    if args.checkpoint_dir:
        path, _ = engine.load_checkpoint(args.checkpoint_dir)
        if path and rank == 0:
            print(f"resumed from {path} at step {engine.global_steps}", flush=True)
    while engine.global_steps < args.steps:
        for batch in loader:
            loss = engine(batch)
            engine.backward(loss)
            before = engine.global_steps
            engine.step()
            if engine.global_steps != before and rank == 0:
                counts = model.last_counts[0].tolist() if model.last_counts else []
                print(f"step {engine.global_steps}/{args.steps} loss {loss.item():.4f} "
                      f"l_aux {float(model.last_aux):.3f} tokens/expert {counts}", flush=True)
            if engine.global_steps >= args.steps:
                break
    if args.checkpoint_dir:
        engine.save_checkpoint(args.checkpoint_dir)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
