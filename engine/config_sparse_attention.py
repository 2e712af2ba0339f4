"""The `sparse_attention` config section, as DeepSpeed wrote it, and the sequence-parallel keys' types.

Parsed by `deepfleet.engine.config.load_config` (torch-free, like every `config_*` module); turned into a
layout object by `deepfleet.engine.attention.sparsity_config.from_config(section, num_heads=...)`, which
a model calls when it builds its attention (DeepSpeed's engine also only carried this section for the
model to read). Keys and defaults are DeepSpeed's (`mode` "fixed", `block` 16, ...; `num_random_blocks`
defaults to 0 here as in DeepSpeed's config parser, though its BigBird class defaults to 1). As in
DeepSpeed, every key is accepted whatever the mode, and a mode reads only its own keys; unlike DeepSpeed,
the checks its layout classes ran when built (window divisibility, matching global index lists,
horizontal attention only when bidirectional) run here, at load time, naming the keys.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from deepfleet.engine.config_base import Bool, ConfigSection, Int

SPARSE_MODES = ("dense", "fixed", "variable", "bigbird", "bslongformer")
SEQ_PARALLEL_DTYPES = ("fp16", "bf16", "fp32")


class SparseAttentionConfig(ConfigSection):
    """`sparse_attention`: the block-sparse layout a model's self-attention uses."""

    mode: Literal["dense", "fixed", "variable", "bigbird", "bslongformer"] = "fixed"
    """Which layout: dense, fixed, variable, bigbird or bslongformer."""
    block: Int = Field(16, gt=0)
    """Tokens per block side; sequence lengths are padded to a multiple of it."""
    different_layout_per_head: Bool = False
    """Give each head its own layout (random blocks, fixed global patterns) instead of head 0's."""
    num_local_blocks: Int = Field(4, gt=0)
    """fixed: blocks per local window."""
    num_global_blocks: Int = Field(1, gt=0)
    """fixed: global blocks per window; bigbird: leading global blocks."""
    attention: Literal["unidirectional", "bidirectional"] = "bidirectional"
    """unidirectional (causal) or bidirectional attention."""
    horizontal_global_attention: Bool = False
    """fixed, variable: global blocks also attend to every block (bidirectional only)."""
    num_different_global_patterns: Int = Field(1, gt=0)
    """fixed: how many different global-block positions heads cycle through."""
    num_random_blocks: Int = Field(0, ge=0)
    """variable, bigbird: random blocks per block row."""
    local_window_blocks: list[Int] = Field(default_factory=lambda: [4], min_length=1)
    """variable: sizes of the local windows in order; the last size repeats."""
    global_block_indices: list[Int] = Field(default_factory=lambda: [0])
    """variable, bslongformer: global blocks (or range starts with global_block_end_indices)."""
    global_block_end_indices: list[Int] | None = None
    """variable, bslongformer: exclusive ends of global block ranges, one per start."""
    num_sliding_window_blocks: Int = Field(3, gt=0)
    """bigbird, bslongformer: blocks in the sliding window around the diagonal."""

    @model_validator(mode="after")
    def _check(self) -> SparseAttentionConfig:
        problems = []
        if self.mode == "fixed":
            if self.num_local_blocks % self.num_global_blocks:
                problems.append(f"num_local_blocks: {self.num_local_blocks} is not a multiple of num_global_blocks "
                                f"{self.num_global_blocks}; make it one")
            elif self.num_different_global_patterns > self.num_local_blocks // self.num_global_blocks:
                problems.append(f"num_different_global_patterns: {self.num_different_global_patterns} exceeds "
                                "num_local_blocks / num_global_blocks; lower it")
            if self.num_different_global_patterns > 1 and not self.different_layout_per_head:
                problems.append("num_different_global_patterns: > 1 needs different_layout_per_head: true; set it")
        if self.mode in ("fixed", "variable") and self.horizontal_global_attention and self.attention != "bidirectional":
            problems.append('horizontal_global_attention: needs attention "bidirectional"; drop one of them')
        if self.mode in ("variable", "bslongformer") and self.global_block_end_indices is not None:
            starts, ends = self.global_block_indices, self.global_block_end_indices
            if len(starts) != len(ends):
                problems.append(f"global_block_end_indices: {len(ends)} ends for {len(starts)} global_block_indices; "
                                "give one end per start")
            elif any(s >= e for s, e in zip(starts, ends, strict=True)):
                problems.append("global_block_end_indices: every end must exceed its start in global_block_indices")
        if self.mode == "variable" and min(self.local_window_blocks) < 1:
            problems.append("local_window_blocks: window sizes must be positive")
        if problems:
            raise ValueError("\n".join(problems))
        return self
