"""The multi-rank training runs behind `test_optimizers.py` and `benchmarks/onebit.py`: Adam and the three
1-bit optimizers trained through `deepfleet.engine.initialize` (ZeRO stage 0) on the peer GPT of
`examples/gpt` with the same data, recording every step's loss (mean over ranks) and the bytes this rank
put on the wire (`StepMetrics.comm_bytes`, from `engine/comm.py`'s counters).

`runs(world_size, steps)` spawns once per (world size, steps) and is cached for the session.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens
from tests.spawn import spawn

MODEL = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_layers=2)
MICRO = 4
FREEZE = 20  # warm-up steps of the 1-bit optimizers (DeepSpeed's default is 100000: real runs are long)

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "Adam": {"lr": 2e-3},
    "OneBitAdam": {"lr": 2e-3, "freeze_step": FREEZE},
    "ZeroOneAdam": {"lr": 2e-3, "var_freeze_step": FREEZE, "var_update_scaler": 4, "local_step_scaler": 40,
                    "local_step_clipper": 2},
    "Lamb": {"lr": 2e-2},
    "OneBitLamb": {"lr": 2e-2, "freeze_step": FREEZE},
}


def config(name: str, params: dict | None = None, **extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": name, "params": params if params is not None else OPTIMIZERS[name]},
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        **extra,
    }


def batches(world_size: int, steps: int) -> list[dict[str, torch.Tensor]]:
    data = SyntheticTokens(num_samples=steps * MICRO * world_size, seq_len=MODEL.seq_len,
                           vocab_size=MODEL.vocab_size, seed=3)
    size = MICRO * world_size
    return [{k: data.tokens[s * size:(s + 1) * size, slice(0, -1) if k == "input_ids" else slice(1, None)]
             for k in ("input_ids", "labels")} for s in range(steps)]


def make_engine(name: str, params: dict | None = None, **extra: object) -> Any:
    import deepfleet.engine as deepfleet

    torch.manual_seed(0)
    model = GPTWithLoss(MODEL)
    engine, *_ = deepfleet.initialize(model=model, model_parameters=model.parameters(), config=config(name, params, **extra))
    return engine


def train(engine: Any, data: list[dict], *, rank: int, world_size: int) -> dict[str, list[float]]:
    """Train over `data`; per step: loss averaged over ranks, this rank's wire bytes, step seconds."""
    import deepfleet.engine.comm as comm

    metrics: list[Any] = []
    engine.sinks.append(metrics.append)
    losses, seconds = [], []
    for batch in data:
        mine = {k: v[rank * MICRO:(rank + 1) * MICRO] for k, v in batch.items()}
        start = time.perf_counter()
        loss = engine(mine)
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - start)
        mean = loss.detach().reshape(1).clone()
        torch.distributed.all_reduce(mean)  # bookkeeping outside engine.comm: not counted as step bytes
        losses.append(float(mean) / world_size)
    engine.sinks.remove(metrics.append)
    del comm
    return {"loss": losses, "bytes": [m.comm_bytes for m in metrics], "seconds": seconds,
            "guard": [(m.comm_compressed, m.comm_compression_error, m.comm_loss_delta) for m in metrics]}


def _all(rank: int, world_size: int, steps: int, names: tuple[str, ...]) -> dict:
    data = batches(world_size, steps)
    return {name: train(make_engine(name), data, rank=rank, world_size=world_size) for name in names}


@functools.cache
def runs(world_size: int, steps: int, names: tuple[str, ...] = tuple(OPTIMIZERS)) -> dict:
    """{optimizer: {"loss", "bytes", "seconds"}} from rank 0."""
    return spawn(_all, world_size, steps, names, timeout=900)[0]
