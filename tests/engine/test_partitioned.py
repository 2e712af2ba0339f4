"""ZeRO stages 1 and 2 (engine/zero/partitioned.py) on 2 and 3 gloo ranks.

Checks: one step equals a single-process AdamW step on the same global batch (directly and through
`deepfleet.engine.initialize`); accumulation issues no collective before the boundary; the clip norm
is the global one; inf/nan on one rank is agreed by all; param groups keep their hyper-parameters;
optimizer state (and at stage 2 gradients) really is 1/N; bf16 keeps fp32 masters close to the fp32 run.
The runs themselves are in `tests/engine/partitioned_runs.py` (one spawn per world size).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine.partitioned_cases import (
    LR,
    global_batch,
    make_model,
    rank_slice,
    reference_run,
    reference_step,
    rows_err,
    step_err,
)
from tests.engine.partitioned_runs import (
    GROUPS_LR,
    MAX_NORM,
    MICRO,
    engine_batches,
    odd_param_groups,
    scenario_runs,
)


@pytest.fixture(scope="module")
def runs() -> dict[int, list[dict]]:
    return scenario_runs()


@pytest.mark.parametrize("world_size", [2, 3])
def test_layout_round_trip_through_all_gather(runs: dict, world_size: int) -> None:
    assert all(r["layout"] for r in runs[world_size])


@pytest.mark.parametrize("kind", ["gpt", "odd"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world_size", [2, 3])
def test_one_step_matches_single_process_adamw(runs: dict, world_size: int, stage: int, kind: str) -> None:
    ref_params, ref_grads, ref_norm = reference_step(kind, global_batch(kind, MICRO * world_size))
    worst_grad = worst_param = 0.0
    covered = {name: 0 for name in ref_params}
    for r in (run[f"step{stage}-{kind}"] for run in runs[world_size]):
        assert r["overflow"] is False
        assert r["norm"] == pytest.approx(ref_norm, rel=1e-5)
        for name, ref in ref_params.items():
            # full, updated params on every rank
            worst_param = max(worst_param, step_err(r["params"][name], ref, ref_grads[name]))
            start, rows = r["rows"][name]
            worst_grad = max(worst_grad, rows_err(r["grad_rows"][name], ref_grads[name], start))
            covered[name] += rows
    assert all(
        covered[n] == max(1, ref_params[n].reshape(-1, *ref_params[n].shape[1:]).shape[0]) for n in covered
    )
    assert worst_grad <= 1e-5, worst_grad
    assert worst_param <= 1e-5, worst_param


@pytest.mark.parametrize("case", ["1", "2", "2-local"])
def test_accumulation_communicates_as_the_stage_says(runs: dict, case: str) -> None:
    """Stage 1, and stage 2 with deepfleet_local_grad_accumulation, are silent until the boundary;
    stage 2 by default (DeepSpeed's semantics) reduce-scatters every bucket on every micro-step, so
    no full gradient outlives its bucket."""
    stage = int(case[0])
    ref_params, ref_grads, _ = reference_step("gpt", global_batch("gpt", 2 * MICRO * 2), micro_steps=2)
    for r in (run[f"accumulate{case}"] for run in runs[2]):
        first, boundary_backward, finish = r["counts"]
        if case == "2":
            assert first == r["buckets"] > 1  # every bucket reduced during the first micro-step too
        else:
            assert first == 0  # no collective while accumulating
        if stage == 2:
            # every bucket is reduce-scattered during the boundary backward; finish only takes the
            # global norm (which is also the inf/nan agreement)
            assert boundary_backward == r["buckets"] > 1
            assert finish == 1
            assert r["full_grads_left"] == 0  # full gradients were freed as their buckets were packed
        else:
            assert boundary_backward == 0
            assert finish == r["chunks"] + 1 > 2  # every chunk, then the norm's all-reduce
        for name, ref in ref_params.items():
            assert step_err(r["params"][name], ref, ref_grads[name]) <= 1e-5, name


def test_stage1_overlap_reduces_the_boundary_during_backward(runs: dict) -> None:
    """Stage 1 with overlap_comm: the non-boundary micro-step is silent; the boundary micro-step issues
    every chunk's all-reduce during its backward — some already before the token embedding's gradient
    exists, which is among the last computed — through engine/comm.py, carrying every parameter's fp32
    gradient once; finish_gradients then issues only the norm's all-reduce. The trained parameters
    are bit-identical to the after-backward path (overlap_comm off), which issues nothing in backward."""
    for overlap, after in zip((r["accumulate1-overlap"] for r in runs[2]), (r["accumulate1"] for r in runs[2]),
                              strict=True):
        first, boundary_backward, finish = overlap["counts"]
        assert first == 0
        assert boundary_backward == overlap["chunks"] > 2
        assert finish == 1
        assert overlap["boundary_bytes"] == 4 * overlap["numel"]
        (issued,) = overlap["before_embedding"]
        assert 0 < issued < overlap["chunks"]
        assert after["before_embedding"] == [0] and after["boundary_bytes"] == 0  # the control
        assert overlap["params"].keys() == after["params"].keys()
        for name, value in after["params"].items():
            assert np.array_equal(overlap["params"][name], value), name


@pytest.mark.parametrize("stage", [1, 2])
def test_clip_norm_is_the_global_norm_and_clips(runs: dict, stage: int) -> None:
    ref_params, ref_grads, ref_norm = reference_step("gpt", global_batch("gpt", MICRO * 3), max_norm=MAX_NORM)
    assert ref_norm > MAX_NORM  # the case really clips
    for r in (run[f"clip{stage}"] for run in runs[3]):
        assert r["norm"] == pytest.approx(ref_norm, rel=1e-5)
        for name, ref in ref_params.items():
            assert step_err(r["params"][name], ref, ref_grads[name]) <= 1e-5, name


@pytest.mark.parametrize("stage", [1, 2])
def test_engine_initialize_trains_like_one_process(runs: dict, stage: int) -> None:
    """Through the public API at 3 ranks: 2 steps of 2 accumulated micro-steps with clipping."""
    ref_params, ref_grads, ref_norms = reference_run("gpt", engine_batches(3), max_norm=MAX_NORM)
    assert min(ref_norms) > MAX_NORM  # every step clips
    for r in (run[f"engine{stage}"] for run in runs[3]):
        assert r["strategy"] == f"ZeroStage{stage}"
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
        for name, ref in ref_params.items():
            assert step_err(r["params"][name], ref, ref_grads[name], steps=2) <= 1e-5, name


def test_stage1_overlap_through_the_engine_is_bit_identical(runs: dict) -> None:
    """Stage 1 with overlap_comm through the public API at 3 ranks (uneven rows), with gradient
    accumulation and clipping: the reduction during the boundary backward gives the after-backward
    path's clip norms and parameters bit for bit (the same chunks, all-reduced from the same inputs)."""
    for overlap, after in zip((r["engine1-overlap"] for r in runs[3]), (r["engine1"] for r in runs[3]), strict=True):
        assert overlap["strategy"] == "ZeroStage1"
        assert overlap["norms"] == after["norms"]
        for name, value in after["params"].items():
            assert np.array_equal(overlap["params"][name], value), name


@pytest.mark.parametrize("stage", [1, 2])
def test_param_groups_keep_their_hyper_parameters_and_frozen_params_stay(runs: dict, stage: int) -> None:
    model = make_model("odd")
    model.lin.bias.requires_grad_(False)
    frozen = model.lin.bias.detach().clone()
    optimizer = torch.optim.AdamW(odd_param_groups(model), lr=LR, weight_decay=0.1)
    model(global_batch("odd", MICRO * 2)).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    for r in (run[f"groups{stage}"] for run in runs[2]):
        assert "param_groups[0].params" in r["foreign"] and "not a parameter of the model" in r["foreign"]
        assert r["groups"] == [(["b", "c"], GROUPS_LR, 0.0), (["lin.weight", "a", "s"], LR, 0.1)]
        assert torch.equal(torch.as_tensor(r["params"]["lin.bias"]), frozen)
        for name, p in model.named_parameters():
            if name in grads:
                assert step_err(r["params"][name], p.detach(), grads[name]) <= 1e-5, name


def test_a_model_given_to_a_second_stage_2_strategy_feeds_only_that_one(runs: dict) -> None:
    ref_params, ref_grads, _ = reference_step("odd", global_batch("odd", MICRO * 2))
    for r in (run["reinitialized"] for run in runs[2]):
        for name, ref in ref_params.items():
            assert step_err(r["params"][name], ref, ref_grads[name]) <= 1e-5, name


@pytest.mark.parametrize("stage", [1, 2])
def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(runs: dict, stage: int) -> None:
    for r in (run[f"fp16-{stage}"] for run in runs[2]):
        assert r["dtype"] == "torch.float16"
        assert [t["changed"] for t in r["trace"]] == [False, True, True]
        assert [t["skipped"] for t in r["trace"]] == [1, 1, 1]
        assert r["trace"][0]["scale"] < 2**8  # the overflow lowered the loss scale


@pytest.mark.parametrize("stage", [1, 2])
def test_inf_on_one_rank_is_reported_by_every_rank(runs: dict, stage: int) -> None:
    results = [run[f"overflow{stage}"] for run in runs[3]]
    assert [r["overflow"] for r in results] == [True, True, True]
    # only the owner of the poisoned row saw it locally: the others learned it from the agreement
    assert [r["local_finite"] for r in results] == [False, True, True]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [1, 2])
def test_partitioned_states_are_one_nth(runs: dict, stage: int, world_size: int) -> None:
    for r in (run[f"memory{stage}"] for run in runs[world_size]):
        full = r["numel"] * 4  # fp32 bytes of one full copy
        assert r["params"] == full  # parameters stay replicated
        # Adam's two moments: 1/N of the full 2 * full bytes, padding included
        assert abs(r["optimizer"] / (2 * full) - 1 / world_size) <= 0.1 / world_size, r
        if stage == 2:
            assert abs(r["grads"] / full - 1 / world_size) <= 0.1 / world_size, r
        else:
            assert r["grads"] == full  # stage 1 keeps full gradients


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_keeps_fp32_masters_close_to_fp32(runs: dict, stage: int) -> None:
    """bf16 forward/backward changes gradients by ~1e-2 relative; Adam's first step moves each weight
    by about lr, so masters may differ from the fp32 run by up to 2 * lr where a gradient's sign flips."""
    ref_params, ref_grads, _ = reference_step("gpt", global_batch("gpt", MICRO * 2))
    for r in (run[f"bf16-{stage}"] for run in runs[2]):
        assert r["dtypes"] == {
            "params": {"torch.bfloat16"},
            "masters": {"torch.float32"},
            "grads": {"torch.float32"},
        }
        assert r["published"]
        for name, ref in ref_params.items():
            assert float((torch.as_tensor(r["masters"][name]) - ref).abs().max()) <= 2 * LR + 1e-6, name
            start, _ = r["rows"][name]
            assert rows_err(r["grad_rows"][name], ref_grads[name], start) <= 5e-2, name


@pytest.mark.parametrize("stage", [1, 2])
def test_a_param_group_reduces_over_its_own_process_group(runs: dict, stage: int) -> None:
    """`b` sits in a param group whose process group is its rank alone (an expert-parallel group in
    miniature): its gradient is that rank's own, the other parameters' the data-parallel mean, and no
    bucket mixes the two groups."""
    world_size = 2
    full = global_batch("odd", MICRO * world_size)
    for rank, r in enumerate(run[f"own-group{stage}"] for run in runs[world_size]):
        model = make_model("odd")
        model(full).backward()
        dense_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        local = make_model("odd")
        local(rank_slice(full, rank, world_size)).backward()
        grads = {**dense_grads, "b": local.b.grad.clone()}
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1).step()
        assert r["unmixed"] and r["b_bucket_size"] == [1]
        assert all("process_group" not in keys for keys in r["keys"])  # the strategy's, not the optimizer's
        for name, p in model.named_parameters():
            assert step_err(r["params"][name], p.detach(), grads[name]) <= 1e-5, (rank, name)
