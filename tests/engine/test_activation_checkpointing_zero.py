"""`deepfleet_activation_checkpointing` under every ZeRO stage on 2 gloo ranks: the engine checkpoints the
tiny GPT's blocks from the config alone, and losses and final parameters equal the plain run's bit for bit
(torch.equal: recomputation replays the same fp32 ops on the same inputs, single-threaded, and the
gradient reductions see identical gradients, so every float matches). One spawn covers all stages."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.engine.zero_runs import adamw, global_batches, make_model, micro_batch
from tests.spawn import spawn

VARIANTS: dict[str, dict[str, Any]] = {
    "off": {},
    "blocks": {"mode": "blocks"},
    "selective-every-2-offload": {"mode": "selective", "every": 2, "offload": True},
}
# each stage runs plain and one checkpointed variant (the two variants alternate over the stages, to keep
# the spawn short); the single-process tests cover every variant on its own
CASES = [(0, "blocks"), (1, "selective-every-2-offload"), (2, "blocks"), (3, "selective-every-2-offload"),
         (3, "blocks")]
STEPS = 2


def _train(rank: int, world_size: int, stage: int, section: dict) -> dict:
    import deepfleet.engine as deepspeed

    model = make_model()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "deepfleet_activation_checkpointing": section}
    engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=adamw)
    losses = []
    for batch in global_batches(world_size)[:STEPS]:
        loss = engine(micro_batch(batch, micro=0, rank=rank, world_size=world_size))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().numpy().copy())
    state = engine.sharding.state_dict()["model"]
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().numpy().copy() for k, v in state.items()}
    engine.destroy()
    dist.barrier()
    return {"losses": losses, "params": params, "checkpointed": [c.recompute for c in engine.checkpointing]}


def _all_stages(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    cases = sorted({(stage, "off") for stage, _ in CASES} | set(CASES))
    return {(stage, name): _train(rank, world_size, stage, VARIANTS[name]) for stage, name in cases}


@functools.cache
def runs() -> list[dict]:
    return spawn(_all_stages, 2, timeout=300)


@pytest.mark.parametrize(("stage", "variant"), CASES)
def test_checkpointed_training_equals_plain_at_every_stage(stage: int, variant: str) -> None:
    for rank_result in runs():
        plain, ac = rank_result[(stage, "off")], rank_result[(stage, variant)]
        assert all(np.array_equal(a, b) for a, b in zip(plain["losses"], ac["losses"], strict=True))
        assert plain["params"].keys() == ac["params"].keys()
        assert all(np.array_equal(plain["params"][k], ac["params"][k]) for k in plain["params"])
        expected = ["full", "full"] if variant == "blocks" else ["selective", "none"]
        assert ac["checkpointed"] == expected
