"""Per-rank model-state memory, measured from the tensors a ZeRO strategy really holds.

Callers: `benchmarks/zero_stages.py` (bytes per stage in `make bench`) and the tests that show what
each ZeRO stage saves. Bytes come from storages, not from shapes: views that share a storage
(gradients living in DDP buckets, shards narrowed out of a padded buffer) count once, at the full size
of the storage, so padding and flat buffers are included. A storage that appears in several categories
is charged to the first of `MODEL_STATE_CATEGORIES` that holds it, so the categories add up to the total.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from deepfleet.engine.zero.base import MODEL_STATE_CATEGORIES, ZeroStrategy


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr())


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's memory on this rank is its local shard.
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def storage_bytes(tensors: Iterable[torch.Tensor], *, seen: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (each storage counted once, at its full size)."""
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        t = _local(t)
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def model_state_bytes(tensors: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """{"params", "grads", "optimizer", "master", "total"} in bytes for one rank."""
    seen: set = set()
    report = {category: storage_bytes(tensors.get(category, []), seen=seen) for category in MODEL_STATE_CATEGORIES}
    report["total"] = sum(report.values())
    return report


def strategy_memory(sharding: ZeroStrategy) -> dict[str, int]:
    """This rank's model-state bytes under `sharding`, by category."""
    return model_state_bytes(sharding.model_state_tensors())
