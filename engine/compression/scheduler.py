"""The compression schedule: which technique is on at which engine step, and its checkpointed state.

Built by `engine/build.py` (or by a user script, as DeepSpeed's `compression_scheduler`) over a model
that `init_compression` prepared; the engine calls `step(global_steps)` after every optimizer step,
and the checkpoint code saves `state_dict()` with the engine state and restores it on load (the step
and every layer's non-persistent compression buffers: L1 masks fixed when pruning began, the
ramp's current ratio, static activation ranges). Everything else about the schedule is a pure
function of the step, so a resumed run continues exactly where the saved one stood.

Masks are computed from weights every replica holds alike, but a static activation range is an
average of each rank's own batches; `step` averages the ranges over the data-parallel group (one
small all-reduce per step), so every replica, the checkpoint and the exported model hold one range.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from deepfleet.engine import comm
from deepfleet.engine.compression.layers import CompressedMixin

log = logging.getLogger(__name__)


class CompressionScheduler:
    """Hands the engine step to every compressed layer of `model` and logs each technique's start."""

    def __init__(self, model: nn.Module, *, step: int = 0, process_group: Any = None) -> None:
        self.group = process_group  # the data-parallel group (None: the default group)
        self.layers: dict[str, CompressedMixin] = {
            name: m for name, m in model.named_modules() if isinstance(m, CompressedMixin)
        }
        self.training_steps = 0
        self._started: set[str] = set()
        self.step(step)

    def step(self, global_step: int | None = None) -> None:
        """Move to `global_step` (default: one step further) and tell every layer."""
        self.training_steps = self.training_steps + 1 if global_step is None else int(global_step)
        self._sync_ranges()
        for layer in self.layers.values():
            layer.set_step(self.training_steps)
            for technique in layer.techniques:
                if technique not in self._started and layer.active(technique):
                    self._started.add(technique)
                    log.info("compression: %s is enabled at step %d", technique, self.training_steps)

    def _sync_ranges(self) -> None:
        ranges = [layer.cq_act_range for layer in self.layers.values() if hasattr(layer, "cq_act_range")]
        if not ranges or not comm.is_initialized() or comm.get_world_size(self.group) == 1:
            return
        flat = torch.stack(ranges)  # (layers, 2): min, max
        comm.all_reduce(flat, op=comm.ReduceOp.AVG, group=self.group)
        with torch.no_grad():
            for r, value in zip(ranges, flat, strict=True):
                r.copy_(value)

    def state_dict(self) -> dict:
        buffers = {
            f"{name}.{key}": buf.detach().clone()
            for name, layer in self.layers.items()
            for key, buf in layer.compression_buffers().items()
        }
        return {"training_steps": self.training_steps, "buffers": buffers}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`; raises ValueError when the saved layers are not this model's."""
        own = {f"{name}.{key}": buf for name, layer in self.layers.items()
               for key, buf in layer.compression_buffers().items()}
        saved = state.get("buffers", {})
        if set(saved) != set(own):
            missing, extra = sorted(set(own) - set(saved)), sorted(set(saved) - set(own))
            raise ValueError(
                f"compression state: the checkpoint's compressed layers differ from the model's "
                f"(missing {missing[:3]}, unexpected {extra[:3]}); load with the same compression_training config"
            )
        with torch.no_grad():
            for key, value in saved.items():
                own[key].copy_(value)
        self.step(int(state["training_steps"]))
