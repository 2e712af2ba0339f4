"""The largest-in-budget benchmark's pieces: its model ladder grows in parameters at every rung (so the
planner's binary search is sound) with the count the model really has, the planner's answer for a
budget is the last rung whose estimate fits, and one real 2-rank verification run measures a
high-water mark above the model state it starts from."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks.largest_in_budget import (
    GIB,
    TECHNIQUES,
    gpt_factory,
    ladder,
    measure,
    param_count,
    planner_bytes,
    planner_largest,
)


def test_the_ladder_grows_depth_then_width_and_counts_parameters_exactly() -> None:
    rungs = ladder(6, 256)
    assert rungs[:5] == [(2, 64), (3, 64), (4, 64), (5, 64), (6, 64)] and rungs[-1] == (6, 256)
    counts = [param_count(r) for r in rungs]
    assert all(a < b for a, b in zip(counts, counts[1:], strict=False))
    for rung in (rungs[0], rungs[-1]):
        with torch.device("meta"):
            model = gpt_factory(*rung)["model"]
        assert sum(p.numel() for p in model.parameters()) == param_count(rung)


def test_the_planner_answer_is_the_last_rung_that_fits() -> None:
    rungs = ladder(4, 192)
    cache: dict = {}
    kw = {"nvme_path": tempfile.gettempdir(), "cache": cache}
    for name in ("ddp", "zero3_checkpointing_nvme"):
        t = TECHNIQUES[name]
        budget = planner_bytes(t, rungs[4], **kw) + 1
        assert planner_largest(t, rungs, budget, **kw) == 4
        assert planner_bytes(t, rungs[5], **kw) > budget
    assert planner_largest(TECHNIQUES["ddp"], rungs, 1024, **kw) is None
    assert planner_bytes(TECHNIQUES["zero3_checkpointing_nvme"], rungs[-1], **kw) < \
        planner_bytes(TECHNIQUES["ddp"], rungs[-1], **kw) < 0.25 * GIB


@pytest.mark.slow
def test_one_verification_run_measures_the_step_above_the_model_state(tmp_path: Path) -> None:
    out = measure("deepfleet", "zero3_checkpointing_nvme", (2, 64), nvme_root=tmp_path, shim=None, timeout=280)
    assert "error" not in out, out
    assert out["params"] == param_count((2, 64))
    for rank in out["per_rank"]:
        assert 0 < rank["start"] < rank["peak"] <= out["measured"]
    assert all(x == x for x in out["losses"])
    chunks = [f for f in tmp_path.rglob("deepfleet-optimizer/*/*") if f.is_file()]
    assert chunks and all(f.stat().st_size > 0 for f in chunks)  # the optimizer state went to files
