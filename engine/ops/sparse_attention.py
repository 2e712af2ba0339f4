"""`deepspeed.ops.sparse_attention` at `deepfleet.engine.ops.sparse_attention`: the names scripts import.

Re-exports only; the code lives in `deepfleet.engine.attention` (layouts, modules, model helpers). DeepSpeed
0.19 removed this module; scripts written for 0.18 and earlier change only the import's first word.
"""

from __future__ import annotations

from deepfleet.engine.attention.model_adapt import SparseAttentionUtils
from deepfleet.engine.attention.sparse_self_attention import BertSparseSelfAttention, SparseSelfAttention
from deepfleet.engine.attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

__all__ = [
    "BSLongformerSparsityConfig",
    "BertSparseSelfAttention",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseAttentionUtils",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
]
