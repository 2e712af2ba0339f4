"""A DeepSpeed CIFAR-10 tutorial-shaped training script (synthetic 32x32 images so it needs no download).
Written against DeepSpeed's API only: it runs unchanged under `deepfleet run`. Rank 0 writes its losses
to --out."""

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
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


def synthetic_cifar(n=256):
    g = torch.Generator().manual_seed(1234)
    images = torch.randn(n, 3, 32, 32, generator=g)
    labels = (images[:, 0, :4, :4].sum(dim=(1, 2)) > 0).long() * 3 + (images[:, 1, :4, :4].sum(dim=(1, 2)) > 0).long()
    return torch.utils.data.TensorDataset(images, labels)


args = add_argument()
deepspeed.init_distributed()
torch.manual_seed(0)
net = Net()
parameters = filter(lambda p: p.requires_grad, net.parameters())
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
