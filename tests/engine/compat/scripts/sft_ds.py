"""A ChatGPT-style supervised fine-tuning step loop (DeepSpeed-Chat's shape: the script builds FusedAdam
itself and passes it to initialize; ZeRO stage from the config; the 16-bit model saved at the end) on a
tiny Hugging Face GPT-2. Written against DeepSpeed's API only. Rank 0 writes its figures to --out."""

import argparse
import json
import os

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.utils import set_random_seed
from transformers import GPT2Config, GPT2LMHeadModel


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--output_dir", type=str, required=True)
    parser.add_argument("--out", type=str, default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def get_optimizer_grouped_parameters(model, weight_decay, no_decay_name_list=("bias", "ln_", "LayerNorm.weight")):
    return [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay_name_list)
                    and p.requires_grad], "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay_name_list)
                    and p.requires_grad], "weight_decay": 0.0},
    ]


args = parse_args()
deepspeed.init_distributed()
set_random_seed(1234)
device = torch.device(get_accelerator().device_name())
model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2))
params = get_optimizer_grouped_parameters(model, weight_decay=0.01)
AdamOptimizer = DeepSpeedCPUAdam if args.offload else FusedAdam
optimizer = AdamOptimizer(params, lr=1e-3, betas=(0.9, 0.95))
model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, args=args, dist_init_required=True)

g = torch.Generator().manual_seed(99 + model.global_rank)
losses = []
for _ in range(args.steps * model.gradient_accumulation_steps()):
    ids = torch.randint(0, 128, (model.train_micro_batch_size_per_gpu(), 16), generator=g).to(device)
    outputs = model(input_ids=ids, labels=ids, use_cache=False)
    model.backward(outputs.loss)
    model.step()
    losses.append(outputs.loss.item())

os.makedirs(args.output_dir, exist_ok=True)
saved = model.save_16bit_model(args.output_dir)
if model.global_rank == 0 and args.out:
    state = torch.load(os.path.join(args.output_dir, "pytorch_model.bin")) if saved else {}
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "stage": model.zero_optimization_stage(), "saved": bool(saved),
                   "keys": len(state), "dtype": str(next(iter(state.values())).dtype) if state else None,
                   "steps": model.global_steps}, f)
