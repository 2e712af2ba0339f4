"""The compression schedule: which technique is on at which engine step, and its checkpointed state.

Built by `engine/build.py` (or by a user script, as DeepSpeed's `compression_scheduler`) over a model
that `init_compression` prepared; the engine calls `step(global_steps)` after every optimizer step,
and the checkpoint code saves `state_dict()` with the engine state and restores it on load (the step
and every layer's non-persistent compression buffers: L1 masks fixed when pruning began, the
ramp's current ratio, static activation ranges). Everything else about the schedule is a pure
function of the step, so a resumed run continues exactly where the saved one stood.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from deepfleet.engine.compression.layers import CompressedMixin

log = logging.getLogger(__name__)


class CompressionScheduler:
    """Hands the engine step to every compressed layer of `model` and logs each technique's start."""

    def __init__(self, model: nn.Module, *, step: int = 0) -> None:
        self.layers: dict[str, CompressedMixin] = {
            name: m for name, m in model.named_modules() if isinstance(m, CompressedMixin)
        }
        self.training_steps = 0
        self._started: set[str] = set()
        self.step(step)

    def step(self, global_step: int | None = None) -> None:
        """Move to `global_step` (default: one step further) and tell every layer."""
        self.training_steps = self.training_steps + 1 if global_step is None else int(global_step)
        for layer in self.layers.values():
            layer.set_step(self.training_steps)
            for technique in layer.techniques:
                if technique not in self._started and layer.active(technique):
                    self._started.add(technique)
                    log.info("compression: %s is enabled at step %d", technique, self.training_steps)

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
