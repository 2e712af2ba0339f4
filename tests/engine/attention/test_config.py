"""The `sparse_attention` section and the sequence-parallel keys: DeepSpeed's keys and defaults, errors
named at load time, `from_config` building each mode's layout, and the `sp` degree."""

from __future__ import annotations

import random

import pytest
import torch

from deepfleet.engine.attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    VariableSparsityConfig,
    from_config,
)
from deepfleet.engine.config import ConfigError, load_config
from deepfleet.engine.parallel import ParallelDims

# A real-world DeepSpeed config's section: every key given, whatever the mode.
DS_SECTION = {
    "mode": "fixed", "block": 16, "different_layout_per_head": True, "num_local_blocks": 4, "num_global_blocks": 1,
    "attention": "bidirectional", "horizontal_global_attention": False, "num_different_global_patterns": 4,
    "num_random_blocks": 0, "local_window_blocks": [4], "global_block_indices": [0],
    "global_block_end_indices": None, "num_sliding_window_blocks": 3,
}


def _load(**extra):
    return load_config({"train_micro_batch_size_per_gpu": 1, **extra})


def test_deepspeed_section_loads_as_written_and_defaults_are_deepspeeds() -> None:
    cfg = _load(sparse_attention=DS_SECTION)
    assert cfg.sparse_attention.model_dump() == DS_SECTION
    defaults = _load(sparse_attention={}).sparse_attention
    assert (defaults.mode, defaults.block, defaults.num_random_blocks, defaults.attention) == (
        "fixed", 16, 0, "bidirectional")
    assert _load().sparse_attention is None


@pytest.mark.parametrize(("section", "expected"), [
    ({"mode": "dense", "block": 8}, DenseSparsityConfig(4, block=8)),
    (DS_SECTION, FixedSparsityConfig(4, block=16, different_layout_per_head=True, num_different_global_patterns=4)),
    ({"mode": "variable", "num_random_blocks": 2, "local_window_blocks": [1, 3], "global_block_indices": [2, 9],
      "global_block_end_indices": [4, 10]},
     VariableSparsityConfig(4, num_random_blocks=2, local_window_blocks=[1, 3], global_block_indices=[2, 9],
                            global_block_end_indices=[4, 10])),
    ({"mode": "bigbird", "num_random_blocks": 1, "num_global_blocks": 2, "attention": "unidirectional"},
     BigBirdSparsityConfig(4, num_random_blocks=1, num_global_blocks=2, attention="unidirectional")),
    ({"mode": "bslongformer", "num_sliding_window_blocks": 5, "global_block_indices": [0, 7]},
     BSLongformerSparsityConfig(4, num_sliding_window_blocks=5, global_block_indices=[0, 7])),
], ids=lambda x: x.get("mode", "fixed") if isinstance(x, dict) else "")
def test_from_config_builds_each_modes_layout(section: dict, expected) -> None:
    built = from_config(_load(sparse_attention=section).sparse_attention, num_heads=4)
    assert type(built) is type(expected)
    random.seed(5)
    got = built.make_layout(expected.block * 12)
    random.seed(5)
    assert torch.equal(got, expected.make_layout(expected.block * 12))
    assert type(from_config(section, num_heads=4)) is type(expected)


@pytest.mark.parametrize(("section", "message"), [
    ({"mode": "sliding"}, "sparse_attention.mode: 'sliding' is not allowed"),
    ({"num_local_blocks": 6, "num_global_blocks": 4}, "sparse_attention.num_local_blocks: 6 is not a multiple"),
    ({"num_different_global_patterns": 2}, "sparse_attention.num_different_global_patterns: > 1 needs"),
    ({"mode": "variable", "attention": "unidirectional", "horizontal_global_attention": True},
     "sparse_attention.horizontal_global_attention: needs"),
    ({"mode": "bslongformer", "global_block_end_indices": [1, 2]}, "sparse_attention.global_block_end_indices: 2 ends"),
    ({"block": 0}, "sparse_attention.block: must be > 0"),
    ({"blocks": 16}, "sparse_attention.blocks: unknown key; did you mean sparse_attention.block?"),
])
def test_bad_sections_fail_at_load_naming_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("?", r"\?").replace("(", r"\(")):
        _load(sparse_attention=section)


def test_sequence_parallel_keys_set_the_sp_degree() -> None:
    cfg = _load(sequence_parallel_size=2, seq_parallel_communication_data_type="bf16")
    assert (cfg.sequence_parallel_size, cfg.seq_parallel_communication_data_type) == (2, "bf16")
    dims = ParallelDims.from_config(cfg, world_size=4)
    assert (dims.sp, dims.dp_size) == (2, 2)
    with pytest.raises(ValueError, match="sp 3"):
        ParallelDims.from_config(_load(sequence_parallel_size=3), world_size=4)
    with pytest.raises(ConfigError, match="seq_parallel_communication_data_type: 'int8' is not allowed"):
        _load(seq_parallel_communication_data_type="int8")
