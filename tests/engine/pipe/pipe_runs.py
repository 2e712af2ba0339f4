"""Rank functions and the small model the pipeline tests share (spawned by tests/spawn.py).

The model: a tied input projection (`TiedLayerSpec("proj")`), four Linear+Tanh layers, and the tied
projection again as the output head (its weight used transposed), MSE loss. Layers are seeded by index
(`seed_layers=True`), so every pipeline split builds the same weights as the one-process reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepfleet.engine.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec

DIM = 8
HIDDEN = 16
MOMENTUM = 0.9  # SGD with momentum: optimizer state for the checkpoint tests, and weights reveal gradients


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def _head(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight  # (batch, HIDDEN) @ (HIDDEN, DIM) -> (batch, DIM)


def layers(*, tied: bool = True, blocks: int = 4) -> list[Any]:
    specs: list[Any] = [TiedLayerSpec("proj", nn.Linear, DIM, HIDDEN, bias=False) if tied
                        else LayerSpec(nn.Linear, DIM, HIDDEN, bias=False)]
    specs += [LayerSpec(Block, HIDDEN) for _ in range(blocks)]
    specs.append(TiedLayerSpec("proj", nn.Linear, DIM, HIDDEN, bias=False, forward_fn=_head) if tied
                 else LayerSpec(nn.Linear, HIDDEN, DIM))
    return specs


def make_model(num_stages: int, **kwargs: Any) -> PipelineModule:
    return PipelineModule(layers(tied=kwargs.pop("tied", True), blocks=kwargs.pop("blocks", 4)),
                          num_stages=num_stages, loss_fn=nn.functional.mse_loss, seed_layers=True,
                          partition_method=kwargs.pop("partition_method", "uniform"), **kwargs)


def data(steps: int, batch: int, *, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches of (inputs, labels), each (batch, DIM)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, DIM, generator=g), torch.randn(batch, DIM, generator=g)) for _ in range(steps)]


def micro_batches(batch: tuple[torch.Tensor, torch.Tensor], *, dp_rank: int, dp_size: int, gas: int) -> list:
    """This data-parallel rank's `gas` micro-batches of a global batch (rank-major, like the sampler)."""
    x, y = batch
    xs, ys = x.chunk(dp_size)[dp_rank], y.chunk(dp_size)[dp_rank]
    return list(zip(xs.chunk(gas), ys.chunk(gas), strict=True))


def reference(steps: int, *, batch: int, lr: float = 0.1, clip: float = 0.0, tied: bool = True,
              blocks: int = 4) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, no pipeline: the losses of `steps` SGD steps on full batches and the final weights."""
    model = make_model(1, tied=tied, blocks=blocks)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    losses = []
    for x, y in data(steps, batch):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def eval_reference(weights: dict[str, torch.Tensor], *, batch: int = 8) -> float:
    """The loss of `weights` on `train`'s evaluation batch (seed 7), in one process."""
    model = make_model(1)
    model.load_state_dict(weights)
    x, y = data(1, batch, seed=7)[0]
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def config(*, micro: int, gas: int, stage: int = 0, schedule: str | None = None, clip: float = 0.0) -> dict:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
        "zero_optimization": {"stage": stage}, "gradient_clipping": clip,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": MOMENTUM}},
    }
    if schedule is not None:
        cfg["pipeline"] = {"schedule": schedule}
    return cfg


def build(pp: int, schedule: str, stage: int, *, micro: int, gas: int, clip: float = 0.0,
          model_kwargs: dict | None = None) -> Any:
    """A pipeline engine over `make_model(pp)` (the module laid out for `schedule`)."""
    from deepfleet.engine.engine import initialize

    kwargs = dict(model_kwargs or {})
    if schedule not in ("GPipe", "1F1B"):
        kwargs["schedule"] = schedule
    model = make_model(pp, **kwargs)
    engine, *_ = initialize(model=model, config=config(micro=micro, gas=gas, stage=stage, schedule=schedule,
                                                        clip=clip))
    return engine


def run_steps(engine: Any, batches: list, *, gas: int) -> list[float]:
    dp, dp_rank = engine.parallel.dp_size, engine.parallel.dp_rank
    return [float(engine.train_batch(iter(micro_batches(b, dp_rank=dp_rank, dp_size=dp, gas=gas)))) for b in batches]


def train(rank: int, world_size: int, pp: int, schedule: str, stage: int, steps: int, micro: int, gas: int,
          clip: float = 0.0, model_kwargs: dict | None = None) -> dict:
    """Train `steps` train_batch calls; returns the losses and this rank's full weights by name."""
    engine = build(pp, schedule, stage, micro=micro, gas=gas, clip=clip, model_kwargs=model_kwargs)
    dp = engine.parallel.dp_size
    losses = run_steps(engine, data(steps, micro * gas * dp), gas=gas)
    weights = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    x, y = data(1, micro * gas * dp, seed=7)[0]
    evaluated: float | str
    try:
        evaluated = float(engine.eval_batch(iter(micro_batches((x, y), dp_rank=engine.parallel.dp_rank, dp_size=dp,
                                                               gas=gas))))
    except ValueError as e:  # V-layout schedules have no forward-only mode
        evaluated = str(e)
    return {"losses": losses, "weights": weights, "first": engine.is_first_stage(), "last": engine.is_last_stage(),
            "norm": engine.get_global_grad_norm(), "eval": evaluated}


def train_cases(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """`train` for each case (keyword arguments) in one set of processes (spawning costs more than a case)."""
    return [train(rank, world_size, **case) for case in cases]


def save_then_resume(rank: int, world_size: int, save: dict, resume: dict, directory: str, steps: int) -> dict:
    """Train `steps - 1` steps with `save`'s layout and checkpoint; build `resume`'s layout (on the same
    ranks), load, and train the last step. Each layout: pp, schedule, stage, micro, gas."""
    first = build(**save)
    batch = save["micro"] * save["gas"] * first.parallel.dp_size
    batches = data(steps, batch)
    losses = run_steps(first, batches[:-1], gas=save["gas"])
    first.save_checkpoint(directory)
    second = build(**resume)
    assert resume["micro"] * resume["gas"] * second.parallel.dp_size == batch, "the global batch must not change"
    second.load_checkpoint(directory)
    losses += run_steps(second, batches[-1:], gas=resume["gas"])
    weights = {k: v.detach().clone() for k, v in second.module.state_dict().items()}
    return {"losses": losses, "weights": weights, "step": second.global_steps}
