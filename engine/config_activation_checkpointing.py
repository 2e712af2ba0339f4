"""Activation-checkpointing config sections: DeepSpeed's `activation_checkpointing` and deepfleet's own
`deepfleet_activation_checkpointing`.

Read by `deepfleet.engine.config.DeepFleetConfig` (the fields), by `engine/compat/checkpointing.py`
(`deepspeed.checkpointing.configure(None, deepspeed_config=...)` and the engine's configure at
`initialize`) and by `engine/activation_checkpointing.py` (the config-driven block mode, applied in
`engine/build.py`). Torch-free.

`activation_checkpointing` keeps DeepSpeed's keys, defaults and meanings: it configures the
`checkpoint(function, *args)` API that a model calls itself (Megatron style); it does not make the
engine checkpoint anything. `deepfleet_activation_checkpointing` is the engine's own: it checkpoints
the blocks of `blocks(model)` without touching the model. Its name cannot be mistaken for a DeepSpeed
key, and a ds_config written for DeepSpeed never sets it.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from deepfleet.engine.config_base import Bool, ConfigSection, Int

OP_GROUPS = ("matmul", "attention")
"""Names of op groups `deepfleet_activation_checkpointing.ops` accepts besides single `aten.<op>` names."""
_ATEN_OP = re.compile(r"^aten\.[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")


class ActivationCheckpointingConfig(ConfigSection):
    """`activation_checkpointing`: DeepSpeed's options of the `deepspeed.checkpointing` API."""

    partition_activations: Bool = False
    """Split each checkpoint's saved inputs over the model-parallel ranks. With model-parallel size 1 (every
    engine here: there is no tensor parallelism in training) the one partition is the whole tensor, so
    true keeps the same bytes and the same numerics as false; an mpu of size > 1 passed to
    `configure` is refused."""
    contiguous_memory_optimization: Bool = False
    """Copy partitioned checkpoints into one preallocated buffer (against fragmentation; needs
    partition_activations and number_checkpoints, as in DeepSpeed). Layout only: the values and the bytes
    held are the same, and torch's caching allocator serves the buffers."""
    cpu_checkpointing: Bool = False
    """Keep each checkpoint's saved inputs in host memory and copy them back for the recomputation. On a
    CPU-only run they are in host memory already, so it changes nothing there."""
    number_checkpoints: Int | None = Field(None, gt=0)
    """Checkpoints per forward, which DeepSpeed uses to size the contiguous buffer."""
    synchronize_checkpoint_boundary: Bool = False
    """Synchronize the accelerator at the start and end of each checkpoint's forward and backward (no
    effect on the CPU, which has no asynchronous queue)."""
    profile: Bool = False
    """Log the forward and the backward (recomputation included) time of each checkpoint call."""

    @field_validator("number_checkpoints", mode="before")
    @classmethod
    def _false_is_unset(cls, value: object) -> object:
        # DeepSpeed's own examples write `"number_checkpoints": false` for "not set".
        return None if value is False else value

    @model_validator(mode="after")
    def _contiguous_needs(self) -> ActivationCheckpointingConfig:
        problems = []
        if self.contiguous_memory_optimization and not self.partition_activations:
            problems.append("contiguous_memory_optimization: needs partition_activations: true (as in DeepSpeed); "
                            "set partition_activations or drop contiguous_memory_optimization")
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            problems.append("contiguous_memory_optimization: needs number_checkpoints (the checkpoints per "
                            "forward); set it or drop contiguous_memory_optimization")
        if problems:
            raise ValueError("\n".join(problems))
        return self


class BlockCheckpointingConfig(ConfigSection):
    """`deepfleet_activation_checkpointing`: checkpoint the model's blocks (`blocks(model)`) from the config,
    without changing the model's code."""

    mode: Literal["off", "blocks", "selective"] = "off"
    """"blocks": recompute the chosen blocks whole in backward; "selective": inside the chosen blocks keep
    the outputs of `ops` and recompute the rest (torchtitan's selective AC); "off": no recomputation."""
    every: Int = Field(1, ge=1)
    """Choose every k-th block, starting with the first: blocks 0, k, 2k, ... counted from 0 (1 = all blocks, 2 =
    the 1st, 3rd, 5th, ...)."""
    ops: list[str] = Field(default_factory=lambda: ["matmul", "attention"])
    """Ops whose outputs "selective" keeps: "matmul" (mm, addmm, bmm, baddbmm), "attention" (the fused
    scaled-dot-product attention kernels) or single ATen ops by name ("aten.mm")."""
    offload: Bool = False
    """Keep in host memory what the blocks save for backward: a checkpointed block's inputs, every tensor a
    block that is not checkpointed saves. On a CPU-only run that memory is host memory already."""

    @field_validator("ops")
    @classmethod
    def _ops(cls, value: list[str]) -> list[str]:
        bad = [op for op in value if op not in OP_GROUPS and not _ATEN_OP.match(op)]
        if bad:
            raise ValueError(f"unknown op name(s) {bad}; use {', '.join(OP_GROUPS)} or ATen names like \"aten.mm\"")
        return value

    @model_validator(mode="after")
    def _selective_needs_ops(self) -> BlockCheckpointingConfig:
        if self.mode == "selective" and not self.ops:
            raise ValueError("ops: empty with mode \"selective\" (it would recompute everything); list ops to keep "
                             "or use mode \"blocks\"")
        return self
