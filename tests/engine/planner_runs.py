"""Measured per-rank high-water marks behind the planner's accuracy test (`test_planner.py`) and
`benchmarks/planner.py`: the tiny GPT trained through `deepfleet.engine.initialize` on gloo ranks, one
warm-up step (optimizer state allocated) and then one measured step under `engine/memory.py`'s
`LiveStorages`, which starts from the model state the strategy holds (its inventory, the module's
parameters, FSDP2's unsharded tensors) and adds every storage the step's ops create until it dies.
The peak over the whole measured step (forward, backward with its reductions, optimizer step) is the
rank's high-water mark.

Checkpointed runs wrap every block in torch's non-reentrant checkpoint (`checkpoint_wrapper`), which
is what the planner's "checkpoint all blocks" choice stands for.
"""

from __future__ import annotations

import functools
from typing import Any

from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

SIZES = {
    "small": GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_layers=2),
    "medium": GPTConfig(vocab_size=256, seq_len=64, d_model=96, n_heads=4, n_layers=4),
}
MICRO = 2
NVME_CHUNK = 8192  # parameters per NVMe chunk (sub_group_size)


def gpt(size: str = "small", seed: int = 0) -> dict[str, Any]:
    """The planner's factory: the tiny GPT of `size` and its synthetic data."""
    import torch

    torch.manual_seed(seed)
    cfg = SIZES[size]
    data = SyntheticTokens(num_samples=8, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, seed=seed)
    return {"model": GPTWithLoss(cfg), "training_data": data}


def engine_config(stage: int, *, micro: int = MICRO, nvme_path: str | None = None,
                  offload_params: bool = False) -> dict[str, Any]:
    """fp32 AdamW at `stage`; with `nvme_path`, the optimizer state offloaded to files there (two
    staging buffers of chunks of `NVME_CHUNK` parameters), and with `offload_params` (stage 3) the
    parameter shards too, none kept in host memory."""
    zero: dict[str, Any] = {"stage": stage}
    if nvme_path:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2}
        zero["sub_group_size"] = NVME_CHUNK
        if offload_params:
            zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2, "max_in_cpu": 0}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def _checkpoint_blocks(model: Any) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    blocks = model.gpt.blocks
    for i in range(len(blocks)):
        blocks[i] = checkpoint_wrapper(blocks[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def measure(rank: int, world_size: int, *, size: str, stage: int, checkpoint: bool, micro: int = MICRO,
            nvme_path: str | None = None, offload_params: bool = False) -> dict:
    """This rank's high-water mark over one steady training step (bytes)."""
    import torch

    import deepfleet.engine as deepfleet
    from deepfleet.engine.memory import LiveStorages, _fsdp_unsharded, fsdp_modules, fsdp_resized_buffers

    job = gpt(size)
    model, data = job["model"], job["training_data"]
    if checkpoint:
        _checkpoint_blocks(model)
    engine, *_ = deepfleet.initialize(model=model, model_parameters=model.parameters(),
                                      config=engine_config(stage, micro=micro, nvme_path=nvme_path,
                                                           offload_params=offload_params))
    rows = [data[(rank * micro + i) % len(data)] for i in range(micro)]
    batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}
    engine.backward(engine(batch))
    engine.step()
    with LiveStorages() as live:
        sharding = engine.sharding
        fsdp = fsdp_modules(sharding.module)
        # Model state is followed through in-place resizes: FSDP2's gathered units and NVMe-offloaded
        # parameter shards change size without an op the tracker sees.
        for tensors in sharding.model_state_tensors().values():
            live.track(tensors, follow_resizes=True)
        live.track(sharding.module.parameters(), follow_resizes=True)
        for tensors in (*_fsdp_unsharded(fsdp), fsdp_resized_buffers(fsdp)):
            live.track(tensors, follow_resizes=True)
        start = live.current
        engine.backward(engine(batch))
        engine.step()
    return {"peak": live.peak, "start": start}


def measure_table(rank: int, world_size: int, cases: list[tuple], nvme_path: str | None = None) -> list[dict]:
    """One measurement per case (size, stage, checkpoint[, "nvme" | "nvme-param"]): "nvme" offloads the
    optimizer state to files, "nvme-param" (stage 3) the parameter shards as well."""
    out = []
    for case in cases:
        size, stage, ckpt, *offload = case
        path = nvme_path if offload else None
        out.append(measure(rank, world_size, size=size, stage=stage, checkpoint=ckpt, nvme_path=path,
                           offload_params=offload == ["nvme-param"]) | {"case": case})
    return out


def table_cases() -> list[tuple]:
    """The planner accuracy table: stages 0-3 x checkpointing on/off x both sizes, stages 1-3 with the
    optimizer state in NVMe files, and stage 3 with parameters and optimizer state there."""
    cases: list[tuple] = [(size, stage, ckpt) for size in SIZES for stage in range(4) for ckpt in (False, True)]
    cases += [(size, stage, ckpt, "nvme") for size in SIZES for stage in (1, 2, 3) for ckpt in (False, True)]
    cases += [(size, 3, ckpt, "nvme-param") for size in SIZES for ckpt in (False, True)]
    return cases


def planned(case: tuple, nvme_path: str) -> Any:
    """The planner's estimate for a table case (an `Estimate`)."""
    from deepfleet.engine.config import load_config
    from deepfleet.engine.planner.estimate import Choice, estimate

    size, stage, ckpt, *offload = case
    prof = profile(size)
    choice = Choice(stage=stage, offload_optimizer="nvme" if offload else "none",
                    offload_param="nvme" if offload == ["nvme-param"] else "none",
                    checkpoint=tuple(range(len(prof.blocks))) if ckpt else ())
    cfg = load_config(engine_config(stage, nvme_path=nvme_path if offload else None,
                                    offload_params=offload == ["nvme-param"]), world_size=2)
    return estimate(prof, cfg, world_size=2, choice=choice)


@functools.cache
def profile(size: str) -> Any:
    """The planner's profile of the GPT of `size` (a `ModelProfile`), measured once per process."""
    from deepfleet.engine.planner.profile import profile_model

    return profile_model(gpt, {"size": size})
