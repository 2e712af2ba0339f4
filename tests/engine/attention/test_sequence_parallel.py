"""Ulysses (plain, GQA, block-sparse, DeepSpeed's DistributedAttention) and ring attention on 2 gloo ranks
equal single-process attention, forward and backward; the layout broadcast and the sequence-shard loader."""

from __future__ import annotations

import pytest
import torch

from deepfleet.engine.attention.data import shard_sequence
from deepfleet.engine.attention.ulysses import seq_to_heads
from tests.engine.attention import sp_runs
from tests.spawn import spawn


def test_sequence_parallel_attention_equals_one_process() -> None:
    results = spawn(sp_runs.attention_cases, 2)
    for rank, cases in enumerate(results):
        assert len(cases) == 9
        for name, err in cases.items():
            assert err < 1e-10, (rank, name, err)


def test_layout_is_broadcast_from_rank_0_and_loader_shards_sequences() -> None:
    results = spawn(sp_runs.layout_broadcast_and_loader, 2)
    assert all(r["same"] for r in results) and results[1]["changed"]
    assert results[0]["shards"] == [[[0, 1, 2, 3]], [[10, 11, 12, 13]]]
    assert results[1]["shards"] == [[[4, 5, 6, 7]], [[14, 15, 16, 17]]]
    assert results[0]["n"] == results[1]["n"] == [0, 1]


def test_single_process_is_the_identity_and_bad_splits_are_named() -> None:
    x = torch.randn(1, 4, 3, 2)
    assert seq_to_heads(x) is x
    with pytest.raises(ValueError, match="does not divide over 2"):
        shard_sequence(torch.zeros(1, 5), rank=0, world=2)


def test_engine_with_sequence_parallelism_matches_one_process_at_every_zero_stage() -> None:
    results = spawn(sp_runs.sp_engine_stages, 2)
    for rank, per_stage in enumerate(results):
        assert sorted(per_stage) == [0, 1, 2, 3]
        for stage, err in per_stage.items():
            assert err < 1e-5, (rank, stage, err)
