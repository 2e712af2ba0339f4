"""A DeepSpeed CIFAR-10 tutorial-shaped training script (synthetic 32x32 images so it needs no download),
with the tutorial's MoE variant (`--moe`: fc3 becomes `deepspeed.moe.layer.MoE` layers, MoE param groups
from `deepspeed.moe.utils`). Written against DeepSpeed's API only: it runs unchanged under `deepfleet run`.
Rank 0 writes its losses to --out."""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--out", type=str, default=None)
    parser.add_argument("--moe", default=False, action="store_true")
    parser.add_argument("--ep-world-size", default=1, type=int)
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1])
    parser.add_argument("--mlp-type", type=str, default="standard")
    parser.add_argument("--top-k", default=1, type=int)
    parser.add_argument("--min-capacity", default=0, type=int)
    parser.add_argument("--noisy-gate-policy", default=None, type=str)
    parser.add_argument("--moe-param-group", default=False, action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 64)
        self.moe = args.moe
        if self.moe:
            fc3 = nn.Linear(64, 64)
            self.moe_layer_list = nn.ModuleList([
                deepspeed.moe.layer.MoE(hidden_size=64, expert=fc3, num_experts=n_e, ep_size=args.ep_world_size,
                                        use_residual=args.mlp_type == "residual", k=args.top_k,
                                        min_capacity=args.min_capacity, noisy_gate_policy=args.noisy_gate_policy)
                for n_e in args.num_experts
            ])
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
        return self.fc2(x)


def create_moe_param_groups(model):
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def synthetic_cifar(n=256):
    g = torch.Generator().manual_seed(1234)
    images = torch.randn(n, 3, 32, 32, generator=g)
    labels = (images[:, 0, :4, :4].sum(dim=(1, 2)) > 0).long() * 3 + (images[:, 1, :4, :4].sum(dim=(1, 2)) > 0).long()
    return torch.utils.data.TensorDataset(images, labels)


args = add_argument()
deepspeed.init_distributed()
torch.manual_seed(0)
net = Net(args)
parameters = filter(lambda p: p.requires_grad, net.parameters())
if args.moe_param_group:
    parameters = create_moe_param_groups(net)
model_engine, optimizer, trainloader, __ = deepspeed.initialize(
    args=args, model=net, model_parameters=parameters, training_data=synthetic_cifar()
)
local_device = get_accelerator().device_name(model_engine.local_rank)
local_rank = model_engine.local_rank
target_dtype = None
if model_engine.bfloat16_enabled():
    target_dtype = torch.bfloat16
elif model_engine.fp16_enabled():
    target_dtype = torch.half

criterion = nn.CrossEntropyLoss()
losses = []
for epoch in range(args.epochs):
    running_loss = 0.0
    for i, data in enumerate(trainloader):
        inputs, labels = data[0].to(local_device), data[1].to(local_device)
        if target_dtype is not None:
            inputs = inputs.to(target_dtype)
        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
        running_loss += loss.item()
        if local_rank == 0 and i % 8 == 7:
            print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / 8 : .3f}")
            running_loss = 0.0

if model_engine.global_rank == 0 and args.out:
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "world_size": deepspeed.comm.get_world_size(),
                   "steps": model_engine.global_steps, "local_rank_arg": args.local_rank}, f)
