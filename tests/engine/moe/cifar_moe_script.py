"""The shape of DeepSpeed's CIFAR-10 MoE tutorial script (DeepSpeedExamples, training/cifar), with its
imports changed to deepfleet and nothing else: a LeNet whose fc3 is a list of `deepspeed.moe.layer.MoE`
layers, MoE param groups from `split_params_into_different_moe_groups_for_optimizer`, and
`deepspeed.initialize(args=..., model=..., model_parameters=..., training_data=...)`. CIFAR images are
replaced by a synthetic dataset of the same shape (no download). Run by `test_deepspeed_moe_script.py`
through `tests/spawn.py`; `main(argv)` returns the per-epoch mean losses.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F

import deepfleet.engine as deepspeed  # was: import deepspeed


def add_argument(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=2, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--moe", default=False, action="store_true")
    parser.add_argument("--ep-world-size", default=1, type=int)
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1])
    parser.add_argument("--mlp-type", type=str, default="standard")
    parser.add_argument("--top-k", default=1, type=int)
    parser.add_argument("--min-capacity", default=0, type=int)
    parser.add_argument("--noisy-gate-policy", default=None, type=str)
    parser.add_argument("--moe-param-group", default=False, action="store_true")
    parser.add_argument("--stage", default=0, type=int)
    parser.add_argument("--deepspeed_config", default=None, type=str)
    return parser.parse_args(argv)


class Net(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.moe = args.moe
        if self.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = []
            for n_e in args.num_experts:
                self.moe_layer_list.append(
                    deepspeed.moe.layer.MoE(hidden_size=84, expert=fc3, num_experts=n_e, ep_size=args.ep_world_size,
                                            use_residual=args.mlp_type == "residual", k=args.top_k,
                                            min_capacity=args.min_capacity, noisy_gate_policy=args.noisy_gate_policy))
            self.moe_layer_list = nn.ModuleList(self.moe_layer_list)
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            x = self.fc4(x)
        else:
            x = self.fc3(x)
        return x


def create_moe_param_groups(model: nn.Module) -> list[dict]:
    from deepfleet.engine.moe.utils import (
        split_params_into_different_moe_groups_for_optimizer,  # was deepspeed.moe.utils
    )

    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def get_ds_config(args: argparse.Namespace) -> dict:
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False, "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True},
    }


def synthetic_cifar(n: int = 256) -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 3, 32, 32, generator=g) * 0.5 + labels.view(-1, 1, 1, 1) / 10.0  # learnable
    return torch.utils.data.TensorDataset(images, labels)


def main(argv: list[str]) -> list[float]:
    args = add_argument(argv)
    deepspeed.init_distributed()
    torch.manual_seed(0)
    trainset = synthetic_cifar()
    net = Net(args)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)
    with tempfile.TemporaryDirectory() as tmp:
        args.deepspeed_config = os.path.join(tmp, "ds_config.json")
        with open(args.deepspeed_config, "w") as f:
            json.dump(get_ds_config(args), f)
        model_engine, optimizer, trainloader, __ = deepspeed.initialize(
            args=args, model=net, model_parameters=parameters, training_data=trainset)
    criterion = nn.CrossEntropyLoss()
    epoch_losses = []
    for _ in range(args.epochs):
        running = []
        for data in trainloader:
            inputs, labels = data[0], data[1]
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            running.append(loss.item())
        epoch_losses.append(sum(running) / len(running))
    return epoch_losses


def spawned(rank: int, world_size: int, argv: list[str]) -> list[float]:
    return main(argv)
