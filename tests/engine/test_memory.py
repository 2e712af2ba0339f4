"""Per-rank model-state memory from real tensor storages (`engine/memory.py`): what each ZeRO stage
saves on 2 ranks, and how storages are counted."""

from __future__ import annotations

import pytest
import torch

from deepfleet.engine.memory import LiveStorages, model_state_bytes, storage_bytes
from tests.engine.zero_runs import run_stage


def test_views_of_one_storage_count_once_at_full_size() -> None:
    flat = torch.zeros(100)  # 400 bytes, e.g. a gradient bucket
    views = [flat[:30], flat[30:90].view(6, 10)]  # 90 of the 100 elements are "used"
    assert storage_bytes(views) == 400
    assert storage_bytes([torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2)]) == 6 + 8


def test_a_storage_shared_by_categories_is_charged_once() -> None:
    p = torch.zeros(10)
    report = model_state_bytes({"params": [p], "master": [p.view(2, 5)], "optimizer": [torch.zeros(5)]})
    assert report == {"params": 40, "grads": 0, "optimizer": 20, "master": 0, "total": 60}


# stage -> categories that must be ~1/N of stage 0 (others stay full size)
SHARDED = {1: {"optimizer"}, 2: {"optimizer", "grads"}, 3: {"optimizer", "grads", "params"}}


@pytest.mark.parametrize(("stage", "world_size"), [(1, 2), (2, 2), (3, 2), (3, 3)])
@pytest.mark.slow
def test_stage_memory_is_a_world_fraction_of_stage_0(stage: int, world_size: int) -> None:
    """Measured after a boundary backward (gradients live, optimizer state from the first step), on
    every rank: sharded categories within 10% of stage 0 / N (padding included), others unchanged.
    Stage 0 holds everything on every rank, so its 2-rank figures are the baseline at any N."""
    base = run_stage(0, 2)[0]["fp32"]["memory"]
    mine = [r["fp32"]["memory"] for r in run_stage(stage, world_size)]
    for rank in range(world_size):
        for category in ("params", "grads", "optimizer"):
            full = base[category]
            assert full > 0, category
            ideal = full / world_size if category in SHARDED[stage] else full
            got = mine[rank][category]
            assert abs(got - ideal) <= 0.10 * ideal, f"rank {rank} {category}: {got} bytes, ideal {ideal:.0f}"


def ideal_bytes(stage: int, params: int, world_size: int) -> float:
    """ZeRO's model-state bytes per rank for fp32 AdamW (4 bytes params, 4 grads, 8 Adam moments):
    stage 0 replicates all (16P); stage 1 partitions the moments (4P + 4P + 8P/N); stage 2 also the
    gradients (4P + 12P/N); stage 3 everything (16P/N)."""
    p, n = params, world_size
    return {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}[stage]


@pytest.mark.parametrize("gas", [1, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_peak_model_state_over_a_step_is_near_the_zero_ideal(stage: int, gas: int) -> None:
    """The high-water mark over each whole optimizer step (every forward, backward, micro-step boundary,
    the optimizer step, and stage 1/2 reduce buckets while their flat buffers live), per rank at 2
    ranks, is within 10% of the ideal. Stage 2 reduces into its gradient shards on every micro-step,
    so accumulating 4 micro-steps holds no full gradients; its reduce buckets are bounded by
    reduce_bucket_size (P/16 here) and released as each lands. Stage 3 reduce-scatters on every
    micro-step too (FSDP2's gradient sync stays on), so it holds no unsharded gradient between units."""
    from tests.engine.memory_runs import memory_runs

    for rank, result in enumerate(memory_runs(2)):
        run = result[(stage, gas)]
        ideal = ideal_bytes(stage, run["params"], 2)
        for step, peak in enumerate(run["peaks"]):
            got = peak["bytes"]
            assert abs(got - ideal) <= 0.10 * ideal, (
                f"rank {rank} step {step}: peak {got} bytes ({got / run['params']:.2f}P) at "
                f"{peak['point']}, ideal {ideal:.0f} ({ideal / run['params']:.2f}P): {peak['report']}"
            )


def test_live_storages_follow_in_place_resizes_of_followed_tensors() -> None:
    # FSDP2 frees and re-gathers a unit by resizing its storages in place, which no dispatch mode sees
    gathered, kept = torch.zeros(1000), torch.zeros(10)
    storage = gathered.untyped_storage()
    with LiveStorages() as live:
        live.track([gathered], follow_resizes=True)
        live.track([kept])
        assert live.current == 4040
        storage.resize_(0)
        torch.ones(3).add_(1)  # any op: the tracker re-reads followed storages around it
        assert live.current == 40
        storage.resize_(4000)
        tmp = torch.ones(250)  # allocated while the unit is gathered again
        assert live.current == 4040 + 1000 and live.peak == 5040
        del tmp
        kept.untyped_storage().resize_(0)  # not followed: counted as first seen
        torch.ones(1)
        assert live.current == 4040
