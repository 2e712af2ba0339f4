"""Shared multi-rank MoE runs: the small MoE GPT (`examples/gpt/moe_model.py`) trained by the engine at
ep_size 1 and at ep_size 2 over the same 2 ranks, at every ZeRO stage, in one spawn (cached), recording
per-step losses, aux losses, gradient norms, the expert counts and the final full parameters.
Read by `tests/engine/moe/test_expert_parallel.py`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from examples.gpt.model import GPTConfig, SyntheticTokens
from examples.gpt.moe_model import MoEArgs, MoEGPTWithLoss
from tests.spawn import spawn

MODEL = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)
MICRO, GAS, STEPS = 2, 2, 5
# Routing per stage, so the four stages together cover both dispatch layouts and k = 1 / 2.
ROUTING = {
    0: {"k": 1, "drop_tokens": True, "use_rts": True},
    1: {"k": 2, "drop_tokens": False},
    2: {"k": 1, "drop_tokens": False},
    3: {"k": 2, "drop_tokens": True, "capacity_factor": 0.75},
}


def make_model(*, stage: int, ep_size: int) -> MoEGPTWithLoss:
    torch.manual_seed(0)
    return MoEGPTWithLoss(MODEL, MoEArgs(num_experts=4, ep_size=ep_size, min_capacity=2, **ROUTING[stage]))


def global_batches(world_size: int, steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    data = SyntheticTokens(num_samples=steps * MICRO * GAS * world_size, seq_len=MODEL.seq_len,
                           vocab_size=MODEL.vocab_size, seed=1)
    rows = [data[i] for i in range(len(data))]
    size = MICRO * GAS * world_size
    return [{k: torch.stack([r[k] for r in rows[s * size:(s + 1) * size]]) for k in ("input_ids", "labels")}
            for s in range(steps)]


def config(stage: int, **extra: Any) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "zero_optimization": {"stage": stage}, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}, **extra}


def full_params(engine: Any) -> dict[str, Any]:
    """name -> full fp32 numpy array of every parameter this rank holds (experts under global ids)."""
    state = engine.sharding.state_dict()["model"]
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().numpy().copy()
            for k, v in sorted(state.items())}


def train(engine: Any, model: MoEGPTWithLoss, *, rank: int, world_size: int, batches: list,
          gas: int = GAS) -> dict:
    out: dict[str, Any] = {"losses": [], "aux": [], "norms": [], "counts": [], "step_losses": []}
    for batch in batches:
        step = []
        for micro in range(gas):
            start = (micro * world_size + rank) * MICRO
            loss = engine({k: v[start:start + MICRO] for k, v in batch.items()})
            engine.backward(loss)
            engine.step()
            out["losses"].append(float(loss.detach()))
            step.append(loss.detach())
            out["aux"].append(float(model.last_aux))
            out["counts"].append([c.tolist() for c in model.last_counts])
        out["norms"].append(engine.get_global_grad_norm())
        mean = torch.stack(step).mean()
        dist.all_reduce(mean)
        out["step_losses"].append(float(mean) / world_size)  # the global batch's mean loss
    return out


def _run(rank: int, world_size: int, stage: int, ep_size: int) -> dict:
    import deepfleet.engine as deepspeed

    model = make_model(stage=stage, ep_size=ep_size)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(stage))
    out = train(engine, model, rank=rank, world_size=world_size, batches=global_batches(world_size))
    out["params"] = full_params(engine)
    out["experts_held"] = sorted({k.split("deepspeed_experts.")[1].split(".")[0]
                                  for k, _ in model.named_parameters() if "deepspeed_experts." in k})
    return out


def parity_run(rank: int, world_size: int) -> dict:
    runs = {(stage, ep): _run(rank, world_size, stage, ep) for stage in range(4) for ep in (1, 2)}
    dist.barrier()
    return runs


@functools.cache
def parity(world_size: int = 2) -> list[dict]:
    """Per rank: {(stage, ep_size): run} for stages 0-3 and ep_size 1, 2."""
    return spawn(parity_run, world_size, timeout=300)


def _resume_run(rank: int, world_size: int, stage: int, ckpt: str, first_ep: int, then_ep: int) -> dict:
    """Train 3 steps at `first_ep`, checkpoint, resume in a fresh engine at `then_ep`, train 2 more."""
    import deepfleet.engine as deepspeed

    batches = global_batches(world_size)
    model = make_model(stage=stage, ep_size=first_ep)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(stage))
    before = train(engine, model, rank=rank, world_size=world_size, batches=batches[:3])
    engine.save_checkpoint(ckpt)
    torch.manual_seed(123)  # the fresh model's own weights must not matter
    fresh = MoEGPTWithLoss(MODEL, MoEArgs(num_experts=4, ep_size=then_ep, min_capacity=2, **ROUTING[stage]))
    engine2, _, _, _ = deepspeed.initialize(model=fresh, config=config(stage))
    engine2.load_checkpoint(ckpt)
    after = train(engine2, fresh, rank=rank, world_size=world_size, batches=batches[3:])
    return {"losses": before["losses"] + after["losses"], "global_steps": engine2.global_steps}


def resume_run(rank: int, world_size: int, ckpt_root: str) -> dict:
    return {(stage, a, b): _resume_run(rank, world_size, stage, f"{ckpt_root}/s{stage}-{a}-{b}", a, b)
            for stage, a, b in ((0, 1, 2), (2, 2, 1), (3, 1, 2))}


def parity4_run(rank: int, world_size: int) -> dict:
    """4 ranks: ep_size 2 leaves expert-data-parallel groups of 2 (experts reduce over them)."""
    runs = {(stage, ep): _run(rank, world_size, stage, ep) for stage in range(4) for ep in (1, 2)}
    dist.barrier()
    return runs


@functools.cache
def parity4() -> list[dict]:
    return spawn(parity4_run, 4, timeout=600)


def _fixed_batch_config(stage: int) -> dict:
    """config(stage) with the global batch fixed (8 samples), so the accumulation steps follow the world size."""
    cfg = config(stage)
    del cfg["gradient_accumulation_steps"]
    return {**cfg, "train_batch_size": MICRO * GAS * 2}


def world_run(rank: int, world_size: int, ckpt: str, steps: tuple[int, int], ep_size: int) -> dict:
    """Resume from `ckpt` if it holds a checkpoint, train global batches steps[0]..steps[1] (8 samples
    each, split over however many ranks run), then checkpoint."""
    import deepfleet.engine as deepspeed

    gas = MICRO * GAS * 2 // (MICRO * world_size)
    batches = global_batches(2)[steps[0]:steps[1]]  # the 2-rank run's global batches, whatever the world
    torch.manual_seed(7 + steps[0])
    model = MoEGPTWithLoss(MODEL, MoEArgs(num_experts=4, ep_size=ep_size, min_capacity=2, **ROUTING[2]))
    engine, _, _, _ = deepspeed.initialize(model=model, config=_fixed_batch_config(2))
    if steps[0]:
        engine.load_checkpoint(ckpt)
    out = train(engine, model, rank=rank, world_size=world_size, batches=batches, gas=gas)
    engine.save_checkpoint(ckpt)
    return {"step_losses": out["step_losses"], "global_steps": engine.global_steps}
