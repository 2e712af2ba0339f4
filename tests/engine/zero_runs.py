"""Shared multi-rank runs for the ZeRO tests: one spawn per (stage, world size) trains the tiny GPT with
the engine (fp32 and bf16) and a plain single-process reference on the same global batches, and records
losses, final parameters, per-rank model-state bytes and the collectives issued per micro-step.

`tests/engine/test_zero_stages.py` and `tests/engine/test_memory.py` read the same cached run, so each
stage costs one spawn per test session.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens
from tests.spawn import spawn

MODEL = GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_layers=2)
MICRO, GAS, STEPS = 2, 2, 5
LR, WEIGHT_DECAY = 1e-3, 0.01


def make_model() -> GPTWithLoss:
    torch.manual_seed(0)
    return GPTWithLoss(MODEL)


def adamw(groups: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY)


def global_batches(world_size: int) -> list[dict[str, torch.Tensor]]:
    """STEPS global batches of MICRO * GAS * world_size samples each."""
    data = SyntheticTokens(num_samples=STEPS * MICRO * GAS * world_size, seq_len=MODEL.seq_len,
                           vocab_size=MODEL.vocab_size, seed=1)
    rows = [data[i] for i in range(len(data))]
    size = MICRO * GAS * world_size
    return [
        {k: torch.stack([r[k] for r in rows[s * size:(s + 1) * size]]) for k in ("input_ids", "labels")}
        for s in range(STEPS)
    ]


def micro_batch(batch: dict, *, micro: int, rank: int, world_size: int) -> dict:
    """Rank `rank`'s slice of a global batch for accumulation micro-step `micro`."""
    start = (micro * world_size + rank) * MICRO
    return {k: v[start:start + MICRO] for k, v in batch.items()}


def config(stage: int, *, bf16: bool = False, local_accumulation: bool = False) -> dict:
    zero: dict[str, Any] = {"stage": stage}
    if local_accumulation:
        zero["deepfleet_local_grad_accumulation"] = True
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
    }


def collectives(prof: Any) -> list[str]:
    """Names of the gloo collectives the profiler saw (process-group ops record `gloo:<op>`)."""
    return [e.name for e in prof.events() if e.name.startswith("gloo:")]


def _train(
    rank: int, world_size: int, stage: int, *, bf16: bool, observe: bool, local_accumulation: bool = False
) -> dict:
    import deepfleet.engine as deepspeed
    from deepfleet.engine.memory import strategy_memory

    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=config(stage, bf16=bf16, local_accumulation=local_accumulation),
                                          optimizer=adamw)
    out: dict[str, Any] = {"losses": [], "comm": {}}
    for step, batch in enumerate(global_batches(world_size)):
        local = []
        for micro in range(GAS):
            mb = micro_batch(batch, micro=micro, rank=rank, world_size=world_size)
            boundary = engine.is_gradient_accumulation_boundary()
            watch = observe and step == 0
            with profile(activities=[ProfilerActivity.CPU]) if watch else _null() as prof:
                loss = engine(mb)
                engine.backward(loss)
                if observe and step == 1 and boundary:
                    # after the boundary backward, before the step: optimizer state (from step 0),
                    # gradients and parameters are all live
                    out["memory"] = strategy_memory(engine.sharding)
                engine.step()
            if watch:
                out["comm"]["boundary" if boundary else "accumulate"] = collectives(prof)
            local.append(loss.detach())
        mean = torch.stack(local).mean()
        dist.all_reduce(mean)
        out["losses"].append(float(mean) / world_size)
    model_state = engine.sharding.state_dict()["model"]
    # numpy arrays travel back by value (tensors would be shared through file descriptors that die
    # with the rank process)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().numpy().copy()
            for k, v in model_state.items()}
    out["params"] = full if rank == 0 else None
    out["global_steps"] = engine.global_steps
    return out


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def reference(world_size: int) -> dict:
    """Plain single-process AdamW on the mean loss over each whole global batch."""
    model = make_model()
    opt = adamw(model.parameters())
    losses = []
    for batch in global_batches(world_size):
        loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {k: v.detach().numpy().copy() for k, v in model.named_parameters()}}


def stage_run(rank: int, world_size: int, stage: int) -> dict:
    result = {
        "fp32": _train(rank, world_size, stage, bf16=False, observe=True),
        "bf16": _train(rank, world_size, stage, bf16=True, observe=False),
    }
    if stage == 3:  # the opt-out: unsharded gradients accumulate locally between boundaries
        result["fp32-local"] = _train(rank, world_size, stage, bf16=False, observe=True, local_accumulation=True)
    if rank == 0:
        result["ref"] = reference(world_size)
    return result


@functools.cache
def run_stage(stage: int, world_size: int = 2) -> list[dict]:
    """Per-rank results of `stage_run`, computed once per test session."""
    return spawn(stage_run, world_size, stage, timeout=240)
