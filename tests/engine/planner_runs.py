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


def engine_config(stage: int, *, micro: int = MICRO, nvme_path: str | None = None) -> dict[str, Any]:
    """fp32 AdamW at `stage`; with `nvme_path`, the optimizer state offloaded to files there (two
    staging buffers of chunks of `NVME_CHUNK` parameters)."""
    zero: dict[str, Any] = {"stage": stage}
    if nvme_path:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2}
        zero["sub_group_size"] = NVME_CHUNK
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
            nvme_path: str | None = None) -> dict:
    """This rank's high-water mark over one steady training step (bytes)."""
    import torch

    import deepfleet.engine as deepfleet
    from deepfleet.engine.memory import LiveStorages, _fsdp_unsharded, fsdp_modules

    job = gpt(size)
    model, data = job["model"], job["training_data"]
    if checkpoint:
        _checkpoint_blocks(model)
    engine, *_ = deepfleet.initialize(model=model, model_parameters=model.parameters(),
                                      config=engine_config(stage, micro=micro, nvme_path=nvme_path))
    rows = [data[(rank * micro + i) % len(data)] for i in range(micro)]
    batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}
    engine.backward(engine(batch))
    engine.step()
    with LiveStorages() as live:
        sharding = engine.sharding
        for tensors in sharding.model_state_tensors().values():
            live.track(tensors)
        live.track(sharding.module.parameters())
        for tensors in _fsdp_unsharded(fsdp_modules(sharding.module)):
            live.track(tensors)
        start = live.current
        engine.backward(engine(batch))
        engine.step()
    return {"peak": live.peak, "start": start}


def measure_table(rank: int, world_size: int, cases: list[tuple], nvme_path: str | None = None) -> list[dict]:
    """One measurement per case (size, stage, checkpoint[, "nvme"])."""
    out = []
    for case in cases:
        size, stage, ckpt, *offload = case
        path = nvme_path if offload == ["nvme"] else None
        out.append(measure(rank, world_size, size=size, stage=stage, checkpoint=ckpt, nvme_path=path) | {"case": case})
    return out
