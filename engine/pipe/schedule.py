"""Pipeline stages and the schedule that drives them, on torch.distributed.pipelining.

Called by `engine/pipe/engine.py` once at `initialize`. torch owns the schedules (GPipe, 1F1B,
Interleaved1F1B, InterleavedZeroBubble, ZBV, DualPipeV), the point-to-point exchange between stages and
the shape inference of the first step; this module only maps `pipeline.schedule` to a schedule class
and wraps each of this rank's chunks in a `PipelineStage`.

`scale_grads=False`: torch's own scaling divides `p.grad` after the last backward, which misses
gradients that a ZeRO-2 strategy has already moved into its partitioned buffers; the engine divides the
loss by the number of micro-batches instead (DeepSpeed's `loss / gradient_accumulation_steps`), which
is the same mean at every ZeRO stage.

Analytical bubble fraction (idle share of a rank's time with p stages, m micro-batches, v chunks per
rank, equal forward and backward cost): GPipe and 1F1B (p - 1) / (m + p - 1); interleaved
(p - 1) / (v * m + p - 1); zero-bubble schedules approach 0 once m >= 2p (`bubble_fraction`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

SCHEDULE_CLASSES: dict[str, str] = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBV": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}
SPLIT_BACKWARD = {"InterleavedZeroBubble", "ZBV", "DualPipeV"}
"""Schedules that split backward into input and weight gradients (weights accumulate outside autograd)."""


def bubble_fraction(name: str, *, stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The analytical idle fraction of a schedule (module docstring)."""
    p, m = stages, micro_batches
    if p == 1:
        return 0.0
    if name in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    if name == "Interleaved1F1B":
        return (p - 1) / (chunks * m + p - 1)
    # zero-bubble: the warm-up/cool-down bubble is filled with weight-gradient work; what remains is
    # about (p - 1) / 3 of a one-chunk step when m < 2p (ZB-H1), and ~0 beyond.
    return max(0.0, (p - 1) / (3 * (chunks * m + p - 1))) if m < 2 * p else 0.0


def build_stages(
    submodules: list[tuple[torch.nn.Module, int]], *, num_parts: int, device: torch.device, group: Any
) -> list[PipelineStage]:
    """One PipelineStage per (module, part index) this rank holds."""
    return [PipelineStage(module, part, num_parts, device, group=group) for module, part in submodules]


def build_schedule(
    name: str, stages: list[PipelineStage], *, micro_batches: int, loss_fn: Callable[[Any, Any], torch.Tensor]
) -> Any:
    """The torch schedule `name` over this rank's stages (one stage for GPipe/1F1B). Raises ValueError
    naming `pipeline.schedule` or `gradient_accumulation_steps` when torch refuses the combination."""
    cls = getattr(torch_schedules, SCHEDULE_CLASSES[name])
    target = stages[0] if len(stages) == 1 and name in ("GPipe", "1F1B") else stages
    try:
        return cls(target, micro_batches, loss_fn=loss_fn, scale_grads=False)
    except (ValueError, RuntimeError, AssertionError) as e:
        raise ValueError(
            f"pipeline.schedule: {name} cannot run {micro_batches} micro-batches "
            f"(gradient_accumulation_steps) on {len(stages)} chunk(s) per rank: {e}; change "
            "gradient_accumulation_steps (a multiple of the stage count works for every schedule)"
        ) from e
