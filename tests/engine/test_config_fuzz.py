"""deepfleet.engine.config under mutated input: every outcome is a config or a ConfigError of well-formed lines.

Realistic configs get values replaced by values of the wrong kind at random dotted paths (seeded, so
failures reproduce). `deepfleet validate` prints a traceback only if `load_config` raises anything else.
"""

from __future__ import annotations

import copy
import random
import re

import pytest

from deepfleet.engine.config import ConfigError, DeepFleetConfig, load_config

SEEDS = [
    {
        "train_batch_size": 32, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 10}},
        "fp16": {"enabled": True, "loss_scale": 0, "hysteresis": 2},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": 5e8,
                              "stage3_prefetch_bucket_size": "auto"},
        "gradient_clipping": 1.0, "steps_per_print": 10,
    },
    {
        "train_micro_batch_size_per_gpu": 4, "bfloat16": {"enabled": True},
        "optimizer": {"type": "lamb", "params": {"lr": 1e-3, "max_coeff": 0.3}},
        "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}},
        "zero_optimization": {"stage": 1, "allgather_bucket_size": 2e8},
        "wandb": {"enabled": False},
    },
]
ODD_VALUES = [None, "auto", "x", "", -1, 0, 1.5, float("inf"), float("nan"), [], [1, 2, 3], {}, {"a": 1}, True,
              False, 10**40, "5e8", "Adam", {"type": "Adam"}, {"enabled": "yes"}]
LINE = re.compile(r"^[^\n:]+: [^\n]+; [^\n]+$")


def _paths(node: dict, prefix: tuple = ()) -> list[tuple]:
    out = []
    for key, value in node.items():
        out.append((*prefix, key))
        if isinstance(value, dict):
            out.extend(_paths(value, (*prefix, key)))
    return out


def _mutate(config: dict, rng: random.Random) -> dict:
    config = copy.deepcopy(config)
    for _ in range(rng.randint(1, 4)):
        path = rng.choice(_paths(config))
        parent = config
        for key in path[:-1]:
            parent = parent[key]
        if rng.random() < 0.2:
            parent[path[-1] + rng.choice(["_", "s", "x"])] = rng.choice(ODD_VALUES)  # a near-miss key
        else:
            parent[path[-1]] = copy.deepcopy(rng.choice(ODD_VALUES))
    return config


@pytest.mark.parametrize("seed", range(8))
def test_mutated_configs_give_a_config_or_well_formed_error_lines(seed: int) -> None:
    rng = random.Random(seed)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(60):
        config = _mutate(rng.choice(SEEDS), rng)
        world_size = rng.choice([1, 2, 3])
        try:
            result = load_config(config, world_size=world_size, hidden_size=rng.choice([None, 64]))
        except ConfigError as e:
            outcomes["error"] += 1
            assert e.errors, config
            bad = [line for line in e.errors if not LINE.match(line)]
            assert bad == [], (config, bad)
        else:
            outcomes["ok"] += 1
            assert isinstance(result, DeepFleetConfig)
            micro, gas = result.train_micro_batch_size_per_gpu, result.gradient_accumulation_steps
            assert result.train_batch_size == micro * gas * world_size
    assert outcomes["error"] > 0
