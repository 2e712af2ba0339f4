"""The `tensor_parallel` section: DeepSpeed's AutoTP training (`autotp_size`, `partition_config`), built
by `deepfleet.engine.autotp` on the mesh's `tp` axis. Torch-free."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from deepfleet.engine.config_base import Bool, ConfigSection, Int
from deepfleet.engine.config_parallel import OFF_VALUES


class LayerSpec(ConfigSection):
    """One entry of `partition_config.layer_specs`: the Linear layers whose `<name>.weight` matches one of
    `patterns` (Python regular expressions, searched in the parameter's dotted name) are split this way."""

    patterns: list[str] = Field(..., min_length=1)
    """Regular expressions over parameter names such as `blocks.0.attn.q_proj.weight`."""
    partition_type: Literal["column", "row", "skip"]
    """column: output features split (input replicated); row: input features split, outputs all-reduced;
    skip: the layer stays whole on every rank."""
    shape: list[Int] | None = None
    """A fused weight's sub-blocks along `partition_dim`, e.g. [3, -1] for q/k/v stacked in one weight:
    each sub-block is split on its own, so every rank holds its share of each."""
    partition_dim: Int | None = None
    """The dim `shape` describes (0 for column layers' output features, the only one supported)."""

    @field_validator("patterns")
    @classmethod
    def _compile(cls, patterns: list[str]) -> list[str]:
        for p in patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"patterns: {p!r} is not a regular expression ({e})") from None
        return patterns

    @model_validator(mode="after")
    def _fused(self) -> LayerSpec:
        if self.shape is not None:
            if self.partition_type != "column" or self.partition_dim not in (None, 0):
                raise ValueError("shape: fused sub-blocks are supported for column layers on partition_dim 0; "
                                 "drop shape or use partition_type column")
            if len(self.shape) != 2 or self.shape[0] < 1 or self.shape[1] != -1:
                raise ValueError(f"shape: {self.shape} unsupported; give [number_of_sub_blocks, -1], e.g. [3, -1]")
        return self


class PartitionConfig(ConfigSection):
    """`tensor_parallel.partition_config`: which layers are split, and how."""

    use_default_specs: Bool = True
    """Also apply the built-in rules (after `layer_specs`, which win) for common layer names."""
    layer_specs: list[LayerSpec] = Field(default_factory=list)
    """Rules tried in order; the first whose pattern matches decides."""


class TensorParallelConfig(ConfigSection):
    """`tensor_parallel`: AutoTP training. With `autotp_size` N > 1 the ranks form groups of N on the mesh's
    innermost axis; within a group each block's Linear layers are split column- then row-parallel
    (Megatron's pairing), so each rank holds 1/N of their weights, and data parallelism (and ZeRO 0-2)
    runs over the other axis."""

    autotp_size: Int = Field(0, ge=0)
    """Tensor-parallel degree; 0 or 1 turns it off."""
    partition_config: PartitionConfig | None = None
    """Custom layer rules; without it the built-in rules decide."""

    @property
    def degree(self) -> int:
        return 1 if self.autotp_size == OFF_VALUES["tp"] else self.autotp_size  # 0 is DeepSpeed's "off"
