"""DeepSpeed Elasticity's batch arithmetic (`deepspeed.elasticity.compute_elastic_config`, re-exported at
`deepfleet.engine.elasticity`), for the `elasticity` section (engine/config_elasticity.py), applied by
`load_config` before the batch is resolved.

The rule (DeepSpeed's, so a job gets the batch DeepSpeed would give it): candidate global batches are
each micro-batch size, and their least common multiple, scaled by the largest highly composite number
(1, 2, 4, 6, 12, 24, 36, ...: the numbers with more divisors than any smaller one) that keeps them at
most `max_train_batch_size`; the candidate that suits the most data-parallel sizes in
[min_gpus, max_gpus] wins (ties: the larger if `prefer_larger_batch`). A size suits a batch when one of the
micro-batch sizes times it divides the batch. Version 0.2 counts sizes in nodes of `num_gpus_per_node`
ranks (over `model_parallel_size`), and for a current size outside the list it takes the largest batch
that size can run. Written here: torch has nothing like it. Torch-free.
"""

from __future__ import annotations

import math
from typing import Any

from deepfleet.engine.config_elasticity import ElasticityConfig


class ElasticityError(ValueError):
    """The elastic config cannot give a batch for this world size (DeepSpeed's ElasticityIncompatibleWorldSize)."""


def _highly_composite(limit: int) -> list[int]:
    """Highly composite numbers up to `limit` (each has more divisors than every smaller number)."""
    out, best, n = [], 0, 1
    while n <= limit:
        count = sum(2 if d * d != n else 1 for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        if count > best:
            out.append(n)
            best = count
        n += 1 if n < 60 else (60 if n % 60 == 0 else 60 - n % 60)  # beyond 60 every one is a multiple of 60
    return out


_HCN_CACHE: dict[int, list[int]] = {}


def _hcn(limit: int) -> list[int]:
    key = max(1, limit)
    if key not in _HCN_CACHE:
        _HCN_CACHE[key] = _highly_composite(key)
    return _HCN_CACHE[key]


def _candidates(bases: list[int], largest: int) -> list[int]:
    out = set()
    for base in bases:
        if base > largest:
            continue
        scale = max(h for h in _hcn(largest // base) if h <= largest // base) if base < largest else 1
        out.add(base * scale)
    return sorted(out)


def _suited_sizes(batch: int, micro: list[int], low: int, high: int) -> list[int]:
    sizes = set()
    for m in micro:
        if batch % m:
            continue
        most = batch // m
        sizes |= {n for n in range(max(1, low), min(most, high) + 1) if most % n == 0}
    return sorted(sizes)


def _best(micro: list[int], largest: int, low: int, high: int, prefer_larger: bool) -> tuple[int, list[int]]:
    bases = [*micro, math.lcm(*micro)]
    chosen, chosen_sizes = min(micro), []
    for batch in _candidates(bases, largest):
        sizes = _suited_sizes(batch, micro, low, high)
        better = len(sizes) > len(chosen_sizes) or (len(sizes) == len(chosen_sizes) and (
            batch > chosen if prefer_larger else batch < chosen))
        if better:
            chosen, chosen_sizes = batch, sizes
    return chosen, chosen_sizes


def _micro_for(batch: int, size: int, micro: list[int]) -> int | None:
    """The largest micro-batch size that divides this size's share of the batch (DeepSpeed's choice)."""
    fitting = [m for m in sorted(set(micro)) if (batch // size) % m == 0]
    return fitting[-1] if fitting else None


def elastic_batch(cfg: ElasticityConfig, world_size: int = 0) -> tuple[int, list[int], int | None]:
    """(global batch, data-parallel sizes it suits, micro-batch size for `world_size`) — the last is None
    when `world_size` is 0. Raises ElasticityError when `world_size` is not one of the suited sizes."""
    micro = list(cfg.micro_batch_sizes)
    if cfg.version == 0.1:
        batch, sizes = _best(micro, cfg.max_train_batch_size, cfg.min_gpus,
                             cfg.max_gpus or cfg.max_train_batch_size // min(micro), cfg.prefer_larger_batch)
    else:
        per_node = cfg.num_gpus_per_node // cfg.model_parallel_size
        nodes_batch, node_sizes = _best(micro, cfg.max_train_batch_size // per_node,
                                        max(1, cfg.min_gpus // cfg.num_gpus_per_node),
                                        max(1, cfg.max_gpus // cfg.num_gpus_per_node), cfg.prefer_larger_batch)
        batch, sizes = nodes_batch * per_node, [n * per_node for n in node_sizes]
        if world_size and world_size not in sizes:  # this size: the largest batch it can run
            options = [m * world_size * (cfg.max_train_batch_size // (m * world_size)) for m in micro
                       if m * world_size <= cfg.max_train_batch_size]
            if not options:
                raise ElasticityError(f"elasticity: {world_size} data-parallel ranks cannot run any of "
                                      f"micro_batch_sizes {micro} within max_train_batch_size "
                                      f"{cfg.max_train_batch_size}")
            batch, sizes = (max(options) if cfg.prefer_larger_batch else min(options)), [world_size]
    if not world_size:
        return batch, sizes, None
    if world_size not in sizes:
        raise ElasticityError(f"elasticity: {world_size} data-parallel ranks do not suit the elastic batch {batch}; "
                              f"run on one of {sizes} ranks or widen micro_batch_sizes / max_train_batch_size")
    micro_size = _micro_for(batch, world_size, micro)
    if micro_size is None:
        raise ElasticityError(f"elasticity: no micro_batch_sizes entry divides {batch} // {world_size}")
    return batch, sizes, micro_size


def compute_elastic_config(ds_config: dict, target_deepspeed_version: str = "", world_size: int = 0,
                           return_microbatch: bool = False) -> tuple[Any, ...]:
    """DeepSpeed's API: `(final_batch_size, valid_gpus)` for a config dict with `elasticity` enabled, and
    the micro-batch size too when `world_size` is given (or `return_microbatch`)."""
    if not isinstance(ds_config, dict) or not isinstance(ds_config.get("elasticity"), dict):
        raise ValueError("ds_config: needs an elasticity section (a dict)")
    cfg = ElasticityConfig.model_validate(ds_config["elasticity"])
    if not cfg.enabled:
        raise ValueError('elasticity.enabled: false; set "enabled": true for an elastic job')
    batch, sizes, micro = elastic_batch(cfg, world_size)
    return (batch, sizes, micro) if world_size or return_microbatch else (batch, sizes)


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def apply_elasticity(data: dict, *, dp_size: int, errors: list[str]) -> None:
    """With `elasticity.enabled`, write the elastic batch keys into the raw config `data` for `dp_size`
    data-parallel ranks (an error line, not an exception, for a bad section or size)."""
    section = data.get("elasticity")
    if not isinstance(section, dict) or section.get("enabled") is not True:
        return
    try:
        cfg = ElasticityConfig.model_validate(section)
    except ValueError:
        return  # the full validation names the bad key
    given = [k for k in BATCH_KEYS if k in data]
    if given and not cfg.ignore_non_elastic_batch_info:
        errors.append(f"{given[0]}: elasticity sets the batch ({', '.join(given)} would be overridden); drop "
                      "them or set elasticity.ignore_non_elastic_batch_info: true")
        return
    try:
        batch, _, micro = elastic_batch(cfg, dp_size)
    except ElasticityError as e:
        errors.append(str(e))
        return
    data.update(train_batch_size=batch, train_micro_batch_size_per_gpu=micro,
                gradient_accumulation_steps=batch // (micro * dp_size))
