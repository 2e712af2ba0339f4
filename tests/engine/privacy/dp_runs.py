"""DP-SGD runs shared by tests/engine/privacy/test_dp_sgd.py: a tiny model, its batches, a per-example
reference implementation of DP-SGD, and the rank function that trains it with the engine."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from deepfleet.engine.privacy import DPSGD

MICRO, STEPS = 2, 2
GLOBAL = 8  # samples per step: 2 ranks x 2 micro-steps x 2, or 1 rank x 4 micro-steps x 2
LR, CLIP, SIGMA, SEED = 0.1, 0.5, 0.7, 11
DIM, CLASSES = 6, 3


class Tiny(nn.Module):
    """Embedding + Linear + LayerNorm + Linear; forward(batch) is the mean cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, DIM)
        self.fc = nn.Linear(2 * DIM, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = torch.cat([self.emb(batch["tok"]), batch["x"]], dim=1)
        return F.cross_entropy(self.head(torch.tanh(self.norm(self.fc(x)))), batch["y"])


def make_model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def global_batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    size = GLOBAL
    return [{"tok": torch.randint(0, 10, (size,), generator=g), "x": torch.randn(size, DIM, generator=g),
             "y": torch.randint(0, CLASSES, (size,), generator=g)} for _ in range(STEPS)]


def micro_batch(batch: dict, *, micro: int, rank: int, world_size: int) -> dict:
    start = (micro * world_size + rank) * MICRO
    return {k: v[start:start + MICRO] for k, v in batch.items()}


def dp_config(stage: int, world_size: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GLOBAL // (MICRO * world_size),
        "zero_optimization": {"stage": stage},
        "deepfleet_differential_privacy": {"enabled": True, "noise_multiplier": SIGMA, "max_grad_norm": CLIP,
                                 "delta": 1e-5, "sample_rate": 0.01, "seed": SEED},
    }


def per_example_grads(model: nn.Module, batch: dict) -> list[list[torch.Tensor]]:
    """One backward per example: [example][param] gradients of that example's loss."""
    out = []
    n = batch["y"].shape[0]
    for i in range(n):
        model.zero_grad()
        with DPSGD.backward_context():  # quiet when the model also carries DP-SGD's hooks
            model({k: v[i:i + 1] for k, v in batch.items()}).backward()
        out.append([p.grad.detach().clone() for p in model.parameters()])
    model.zero_grad()
    return out


def reference_dp_sgd() -> list[torch.Tensor]:
    """DP-SGD written out in one process: per-example gradients, each clipped to CLIP over all parameters,
    summed over the global batch, plus one N(0, (SIGMA*CLIP)^2) draw per parameter from the step's seed
    (SEED + step, parameters in model order), divided by the global batch; then plain SGD."""
    model = make_model()
    params = list(model.parameters())
    for step, batch in enumerate(global_batches()):
        grads = per_example_grads(model, batch)
        total = [torch.zeros_like(p) for p in params]
        for example in grads:
            norm = math.sqrt(sum(float(g.pow(2).sum()) for g in example))
            factor = min(1.0, CLIP / (norm + 1e-6))
            for t, g in zip(total, example, strict=True):
                t.add_(g, alpha=factor)
        gen = torch.Generator().manual_seed(SEED + step)
        b = batch["y"].shape[0]
        with torch.no_grad():
            for p, t in zip(params, total, strict=True):
                noise = torch.normal(0.0, SIGMA * CLIP, size=p.shape, generator=gen)
                p.sub_((t + noise) / b, alpha=LR)
    return [p.detach().clone() for p in params]


def train_rank(rank: int, world_size: int, stages: list[int], checkpoint_dir: str | None = None) -> dict[int, Any]:
    """Train with the engine at each stage on `world_size` gloo ranks; the full parameters and epsilon.
    With `checkpoint_dir`, the last engine is saved there and a fresh engine loads it ("resumed_epsilon")."""
    import deepfleet.engine as deepspeed

    out: dict[int, Any] = {}
    for stage in stages:
        model = make_model()
        engine, *_ = deepspeed.initialize(model=model, config=dp_config(stage, world_size),
                                          optimizer=lambda groups: torch.optim.SGD(groups, lr=LR))
        seen = []
        engine.sinks.append(seen.append)
        for batch in global_batches():
            for micro in range(GLOBAL // (MICRO * world_size)):
                loss = engine(micro_batch(batch, micro=micro, rank=rank, world_size=world_size))
                engine.backward(loss)
                engine.step()
        out[stage] = {"params": [p.detach().float().clone() for p in model.parameters()],
                      "epsilon": engine.privacy_spent(), "metric_epsilon": [m.dp_epsilon for m in seen]}
        if checkpoint_dir is not None:
            engine.save_checkpoint(checkpoint_dir, tag="dp")
            again, *_ = deepspeed.initialize(model=make_model(), config=dp_config(stage, world_size),
                                             optimizer=lambda groups: torch.optim.SGD(groups, lr=LR))
            again.load_checkpoint(checkpoint_dir, tag="dp")
            out[stage]["resumed_epsilon"] = again.privacy_spent()
            again.destroy()
        engine.destroy()
    return out
