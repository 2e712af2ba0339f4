"""Runs for `test_nvme_offload.py`: a tiny MLP trained on 2 gloo ranks at ZeRO stages 1-3 with and
without NVMe optimizer offload, and a save / new engine / load / continue resume with offload."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

STEPS, SAVE_AT = 4, 2


def _config(stage: int, nvme: str | None) -> dict:
    zero: dict = {"stage": stage}
    if nvme is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme, "buffer_count": 2,
                                     "pipeline_read": True, "pipeline_write": True}
        zero["sub_group_size"] = 40  # several chunks per step
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3}},
        "zero_optimization": zero,
        "aio": {"block_size": 4096, "queue_depth": 2, "thread_count": 2},
    }


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.b(torch.tanh(self.a(x))) - y) ** 2).mean()


def _engine(stage: int, nvme: str | None):
    import deepfleet.engine as deepfleet

    torch.manual_seed(0)
    model = _Net()
    engine, *_ = deepfleet.initialize(model=model, model_parameters=model.parameters(),
                                      config=_config(stage, nvme))
    return engine


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def train(engine, steps: range) -> list[float]:
    """Losses of `steps` training steps on this rank's batches of those steps (shared by the runs of
    the parameter offload, nvme_param_runs.py)."""
    losses = []
    for s in steps:
        loss = engine(*batch(s, torch.distributed.get_rank()))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def stage_run(rank: int, world_size: int, root: str) -> dict:
    out: dict = {}
    for stage in (1, 2, 3):
        base = train(_engine(stage, None), range(STEPS))
        nvme = str(Path(root) / f"nvme{stage}")
        os.makedirs(nvme, exist_ok=True)
        engine = _engine(stage, nvme)
        offload = engine.sharding.offload
        files = sorted(p.name for p in offload.directory.iterdir())
        first = train(engine, range(SAVE_AT))
        resident = sum(len(s) for s in engine.optimizer.state.values() if s)
        ckpt = str(Path(root) / f"ckpt{stage}")
        engine.save_checkpoint(ckpt, tag="t")
        rest = train(engine, range(SAVE_AT, STEPS))
        # a killed run's leftovers in the directory a resumed engine uses: a partial .tmp and a
        # garbage chunk under a final name; neither may be read
        (offload.directory / "chunk00000.bin.tmp").write_bytes(b"\x7f" * 13)
        (offload.directory / "chunk00000.bin").write_bytes(b"\xff" * 64)
        resumed = _engine(stage, nvme)
        leftovers = sorted(p.name for p in resumed.sharding.offload.directory.iterdir())
        resumed.load_checkpoint(ckpt, tag="t")
        after = train(resumed, range(SAVE_AT, STEPS))
        resumed.sharding.offload.wait()
        out[stage] = {
            "base": base, "nvme": first + rest, "resumed": after, "files_before": files,
            "leftovers": leftovers, "resident_between_steps": resident,
            "written": offload.bytes_written, "read": offload.bytes_read,
            "tmp_after": sorted(p.name for p in resumed.sharding.offload.directory.glob("*.tmp")),
        }
    return out
