"""DeepSpeed Elasticity (`elasticity`): the global batch chosen to suit many data-parallel sizes, and each
size's micro-batch and accumulation steps, by DeepSpeed's rule; the batch keys it takes over."""

from __future__ import annotations

import pytest

from deepfleet.engine.config import ConfigError, load_config
from deepfleet.engine.elasticity import compute_elastic_config

SMALL = {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2, 4], "version": 0.1}


def test_the_batch_suits_the_most_sizes_and_each_size_gets_its_micro_batch() -> None:
    # candidates: 2 x 24 (the largest highly composite number <= 32), 4 x 12, lcm 4 x 12 -> 48, which
    # 1, 2, 3, 4, 6, 8, 12 and 24 ranks can run (micro 2 or 4 times the size divides 48)
    assert compute_elastic_config({"elasticity": SMALL}, "0.19") == (48, [1, 2, 3, 4, 6, 8, 12, 24])
    for world, micro, gas in ((4, 4, 3), (2, 4, 6), (3, 4, 4), (8, 2, 3), (24, 2, 1)):
        cfg = load_config({"elasticity": SMALL}, world_size=world)
        assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == \
            (48, micro, gas), world
    # DeepSpeed's documented example: 1680 over 32 sizes; at 8 ranks micro 6 (1680 / 8 = 210 = 6 x 35)
    example = {"elasticity": {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6],
                              "min_gpus": 1, "max_gpus": 10000, "min_time": 20, "version": 0.1}}
    batch, sizes, micro = compute_elastic_config(example, "0.19", world_size=8)
    assert (batch, len(sizes), micro) == (1680, 32, 6)


def test_version_02_counts_nodes_and_runs_any_size() -> None:
    section = {"enabled": True, "max_train_batch_size": 256, "micro_batch_sizes": [2, 4], "version": 0.2,
               "num_gpus_per_node": 4, "min_gpus": 4, "max_gpus": 64}
    batch, sizes = compute_elastic_config({"elasticity": section}, "0.19")
    assert all(s % 4 == 0 for s in sizes) and batch % 4 == 0
    # 6 ranks (not whole nodes): the largest batch they run, 2 x 6 x floor(256 / 12) = 252, beats 4 x 6 x 10
    odd = load_config({"elasticity": section}, world_size=6)
    assert (odd.train_batch_size, odd.train_micro_batch_size_per_gpu, odd.gradient_accumulation_steps) == (252, 2, 21)


def test_sizes_and_batch_keys_it_cannot_honour_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match=r"5 data-parallel ranks do not suit the elastic batch 48; run on one of "
                                          r"\[1, 2, 3, 4, 6, 8, 12, 24\]"):
        load_config({"elasticity": SMALL}, world_size=5)
    with pytest.raises(ConfigError, match=r"train_batch_size: elasticity sets the batch \(train_batch_size would be overridden\); drop them or set elasticity.ignore_non_elastic_batch_info: true"):
        load_config({"elasticity": SMALL, "train_batch_size": 32}, world_size=2)
    cfg = load_config({"elasticity": {**SMALL, "ignore_non_elastic_batch_info": True}, "train_batch_size": 32,
                       "gradient_accumulation_steps": 1}, world_size=2)
    assert cfg.train_batch_size == 48 and cfg.gradient_accumulation_steps == 6
    with pytest.raises(ConfigError, match="elasticity.micro_batch_sizes: \\[128\\] outside"):
        load_config({"elasticity": {**SMALL, "micro_batch_sizes": [128]}}, world_size=2)
    with pytest.raises(ConfigError, match="elasticity.max_gpu: unknown key; did you mean"):
        load_config({"elasticity": {**SMALL, "max_gpu": 8}}, world_size=2)
    off = load_config({"elasticity": {**SMALL, "enabled": False}, "train_batch_size": 8}, world_size=2)
    assert off.train_batch_size == 8
