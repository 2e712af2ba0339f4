"""DeepSpeedExamples' pipeline-parallelism example shape (training/pipeline_parallelism/train.py): a
sequential net flattened into a layer list, `PipelineModule(layers=..., loss_fn=..., num_stages=...,
partition_method=..., activation_checkpoint_interval=0)`, `engine.train_batch()` over a RepeatingLoader.
Written against DeepSpeed's API only. Rank 0 writes its losses to --out."""

import argparse
import json

import deepspeed
import torch
import torch.nn as nn
from deepspeed.pipe import PipelineModule


def get_args():
    parser = argparse.ArgumentParser(description="pipeline")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("-s", "--steps", type=int, default=6)
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--backend", type=str, default="gloo")
    parser.add_argument("--seed", type=int, default=1138)
    parser.add_argument("--out", type=str, default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def join_layers(vision_model):
    layers = [*vision_model.features, vision_model.avgpool, lambda x: torch.flatten(x, 1), *vision_model.classifier]
    return layers


class SmallNet(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))


def synthetic_cifar(n=256):
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 3, 16, 16, generator=g) * 0.5 + labels.view(-1, 1, 1, 1) / 10.0
    return torch.utils.data.TensorDataset(images, labels)


args = get_args()
deepspeed.init_distributed(dist_backend=args.backend)
torch.manual_seed(args.seed)
deepspeed.runtime.utils.set_random_seed(args.seed)
net = PipelineModule(layers=join_layers(SmallNet()), loss_fn=torch.nn.CrossEntropyLoss(),
                     num_stages=args.pipeline_parallel_size, partition_method="parameters",
                     activation_checkpoint_interval=0)
engine, _, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=[p for p in net.parameters()
                                                                              if p.requires_grad],
                                       training_data=synthetic_cifar())
losses = []
for _ in range(args.steps):
    loss = engine.train_batch()
    losses.append(float(loss))
if engine.global_rank == 0 and args.out:
    with open(args.out, "w") as f:
        json.dump({"losses": losses, "first": engine.is_first_stage(), "steps": engine.global_steps}, f)
