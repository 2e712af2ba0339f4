"""The multi-rank runs behind `test_zero_optimizers.py`: every optimizer the config accepts, trained
through `deepfleet.engine.initialize` at ZeRO stages 0-3 on the tiny GPT of `zero_runs.py`.

One spawn per world size runs every (optimizer, stage) pair inside the ranks, one after another, and
is cached for the test session; rank 0 returns each run's final full parameters (numpy, by value).
Small reduce/all-gather buckets make stages 1/2 span several buckets, so row shards of one parameter
really sit on different ranks.
"""

from __future__ import annotations

import functools
from typing import Any

from tests.engine.zero_runs import MICRO, STEPS, global_batches, make_model, micro_batch
from tests.spawn import spawn

# Hyper-parameters chosen so 5 steps move the weights by many parity tolerances (1e-4).
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "Adam": {"lr": 1e-3, "weight_decay": 0.01, "adam_w_mode": False},
    "AdamW": {"lr": 1e-3, "weight_decay": 0.01},
    "SGD": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
    "Adagrad": {"lr": 1e-2, "weight_decay": 0.01},
    "Lamb": {"lr": 1e-2, "weight_decay": 0.01},
    "Lion": {"lr": 3e-4, "weight_decay": 0.01},
}
BUCKET = 4000  # elements: the tiny GPT spans dozens of buckets
GAS = 1  # one micro-step per optimizer step keeps the 27 runs short (test_zero_stages.py accumulates)


# world size -> (optimizers, stages) run there
PLAN: dict[int, tuple[tuple[str, ...], tuple[int, ...]]] = {
    2: (tuple(OPTIMIZERS), (0, 1, 2, 3)),
    3: (("Lamb",), (0, 1, 2)),
}


def config(stage: int, name: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": name, "params": OPTIMIZERS[name]},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET},
        "steps_per_print": 10**9,
    }


def _train(rank: int, world_size: int, stage: int, name: str) -> dict | None:
    import deepfleet.engine as deepfleet

    model = make_model()
    engine, *_ = deepfleet.initialize(model=model, model_parameters=model.parameters(), config=config(stage, name))
    for batch in global_batches(world_size):  # each holds 2 micro-batches per rank; the first is used
        engine.backward(engine(micro_batch(batch, micro=0, rank=rank, world_size=world_size)))
        engine.step()
    assert engine.global_steps == STEPS
    state = engine.sharding.state_dict()["model"]
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}
    return {k: v.detach().float().numpy().copy() for k, v in full.items()} if rank == 0 else None


def _all(rank: int, world_size: int) -> dict:
    names, stages = PLAN[world_size]
    return {(name, stage): _train(rank, world_size, stage, name) for name in names for stage in stages}


@functools.cache
def optimizer_runs(world_size: int) -> dict:
    """{(optimizer, stage): final parameters} from rank 0, computed once per session."""
    return spawn(_all, world_size, timeout=600)[0]
