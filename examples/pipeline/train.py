"""A pipeline-parallel training script in the shape of DeepSpeed's pipeline example
(DeepSpeedExamples `training/pipeline_parallelism/train.py`): a CNN flattened into a layer list, a
`PipelineModule` partitioned by parameters, `initialize(args=..., training_data=...)` and
`engine.train_batch()` in a loop. Only the two import lines differ from a DeepSpeed script.

Run: `torchrun --nproc-per-node 2 -m examples.pipeline.train --deepspeed_config ds_config.json -p 2`.
The data is synthetic (CIFAR-shaped, 3x32x32 images, 10 classes), so it needs no download.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import deepfleet.engine as deepspeed  # DeepSpeed: import deepspeed
from deepfleet.engine.pipe import PipelineModule  # DeepSpeed: from deepspeed.pipe import PipelineModule


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Linear(16 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, num_classes))


def join_layers(net: SmallCNN) -> list:
    """The model as one list of layers (the example's `join_layers`)."""
    return [*net.features, lambda x: torch.flatten(x, 1), *net.classifier]


class SyntheticImages(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 3, 32, 32, generator=g)
        self.y = self.x.flatten(1)[:, :10].argmax(1)  # a learnable label: which of the first pixels is largest

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def get_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="pipeline example")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("-s", "--steps", type=int, default=10)
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--backend", type=str, default="gloo")
    parser.add_argument("--seed", type=int, default=1138)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def train_pipe(args: argparse.Namespace, part: str = "parameters") -> list[float]:
    torch.manual_seed(args.seed)
    net = SmallCNN(num_classes=10)
    net = PipelineModule(layers=join_layers(net), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method=part,
                         activation_checkpoint_interval=0)
    trainset = SyntheticImages()
    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=trainset)
    losses = []
    for _ in range(args.steps):
        losses.append(float(engine.train_batch()))
    return losses


def main(argv: list[str] | None = None) -> list[float]:
    args = get_args(argv)
    deepspeed.init_distributed(dist_backend=args.backend)
    return train_pipe(args)


if __name__ == "__main__":
    main()
