"""A DeepSpeed BERT pre-training tutorial-shaped script (a tiny Hugging Face BertForMaskedLM on synthetic
masked tokens) that checkpoints and resumes. Written against DeepSpeed's API only. Rank 0 writes the
losses of this run to --out."""

import argparse
import json
import os

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import RepeatingLoader, log_dist
from transformers import BertConfig, BertForMaskedLM


def get_arguments():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--checkpoint_dir", type=str, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save_at", type=int, default=3)
    parser.add_argument("--load", action="store_true")
    parser.add_argument("--out", type=str, default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class MaskedTokens(torch.utils.data.Dataset):
    def __init__(self, n=512, seq=16, vocab=96):
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(5, vocab, (n, seq), generator=g)
        self.mask = torch.rand(n, seq, generator=g) < 0.15

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = torch.where(self.mask[i], self.ids[i], torch.full_like(self.ids[i], -100))
        inputs = torch.where(self.mask[i], torch.full_like(self.ids[i], 4), self.ids[i])
        return {"input_ids": inputs, "labels": labels}


args = get_arguments()
deepspeed.init_distributed()
torch.manual_seed(42)
config = BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=32)
model = BertForMaskedLM(config)
model_engine, optimizer, loader, scheduler = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=args.deepspeed_config, training_data=MaskedTokens()
)
device = get_accelerator().current_device_name()
start_step = 0
if args.load:
    load_path, client_state = model_engine.load_checkpoint(args.checkpoint_dir)
    start_step = client_state["step"]
    log_dist(f"resumed from {load_path} at step {start_step}", ranks=[0])

data_iter = iter(RepeatingLoader(loader))
losses = {}
step = start_step
while step < args.steps:
    batch = next(data_iter)
    batch = {k: v.to(device) for k, v in batch.items()}
    loss = model_engine(**batch).loss
    model_engine.backward(loss)
    model_engine.step()
    if model_engine.global_steps > step:
        step = model_engine.global_steps
        losses[step] = loss.item()
        if step == args.save_at and not args.load:
            model_engine.save_checkpoint(args.checkpoint_dir, client_state={"step": step})
            log_dist(f"saved at step {step}", ranks=[0])

if model_engine.global_rank == 0 and args.out:
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "lr": model_engine.get_lr()[0], "pid": os.getpid()}, f)
