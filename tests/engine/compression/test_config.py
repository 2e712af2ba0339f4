"""The `compression_training` section: DeepSpeed's shapes accepted, defaults, bad input named."""

from __future__ import annotations

import pytest

from deepfleet.engine.config import ConfigError, load_config
from tests.engine.compression.models import bert_config, gpt2_w8a8_config

BASE = {"train_micro_batch_size_per_gpu": 2}


def test_real_world_shapes_parse_with_deepspeed_defaults() -> None:
    gpt = load_config({**BASE, "compression_training": gpt2_w8a8_config()}).compression_training
    wq = gpt.weight_quantization
    assert wq.shared_parameters.quantize_groups == 64 and wq.shared_parameters.fp16_mixed_quantize.enabled is False
    assert wq.shared_parameters.fp16_mixed_quantize.quantize_change_ratio == 0.001
    assert list(wq.different_groups) == ["wq1", "wq2"] and wq.different_groups["wq1"].params.quantization_period == 0
    assert gpt.activation_quantization.different_groups["aq1"].params.bits == 8
    assert set(gpt.techniques()) == {"weight_quantization", "activation_quantization"}

    bert = load_config({**BASE, "compression_training": bert_config()}).compression_training
    assert bert.layer_reduction.teacher_layer == [1, 3]
    assert bert.head_pruning.different_groups["rp1"].related_modules == [["self.query", "self.key", "self.value"]]
    assert bert.sparse_pruning.shared_parameters.schedule_offset_end == 2  # defaults to the offset
    # untouched techniques keep DeepSpeed's defaults
    assert bert.activation_quantization.shared_parameters.schedule_offset == 1000
    assert bert.channel_pruning.shared_parameters.method == "l1"
    assert bert.head_pruning.shared_parameters.method == "topk"


def test_section_round_trips_through_to_dict() -> None:
    cfg = load_config({**BASE, "compression_training": bert_config()})
    assert load_config(cfg.to_dict()).compression_training == cfg.compression_training


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ({"sparse_pruning": {"shared_parameters": {"enabled": True}}},
         "compression_training.sparse_pruning.different_groups: required"),
        ({"sparse_pruning": {"shared_parameters": {"method": "snip_momentum"}}}, "Intel Neural Compressor"),
        ({"head_pruning": {"shared_parameters": {"enabled": True},
                           "different_groups": {"h": {"params": {"dense_ratio": 0.5}}}}},
         "head_pruning.shared_parameters.num_heads: required"),
        ({"weight_quantization": {"different_groups": {"w": {"params": {"start_bits": 4, "target_bits": 8}}}}},
         "target_bits: 8 > start_bits 4"),
        ({"weight_quantization": {"different_groups": {"w": {"params": {"start_bits": 8}}}}},
         "different_groups.w.params.target_bits: missing"),
        ({"activation_quantization": {"different_groups": {"a": {"params": {"bits": 6}}}}}, "bits"),
        ({"row_pruning": {"different_groups": {"r": {"params": {"dense_ratio": 0.5}, "modules": ["(x"]}}}},
         "not a regular expression"),
        ({"sparse_pruning": {"shared_parameters": {"block_pattern": "4x1"}}}, "not an N:M pattern"),
        ({"sparse_pruning": {"shared_parameters": {"block_pattern": "2:4"},
                             "different_groups": {"s": {"params": {"dense_ratio": 0.3}}}}}, "set it to 0.5"),
        ({"layer_reduction": {"enabled": True, "module_name_prefix": "m.layers", "teacher_layer": [0, 2],
                              "keep_number_layer": 3}}, "keep_number_layer: 3 != 2"),
        ({"row_pruning": {"shared_parameters": {"enabld": True}}}, "row_pruning.shared_parameters.enabld: unknown key"),
        ({"pruning": {}}, "compression_training.pruning: unknown key"),
    ],
)
def test_bad_sections_fail_naming_the_key(section: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config({**BASE, "compression_training": section})
    assert needle in str(e.value), str(e.value)
