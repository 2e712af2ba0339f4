"""The pipeline engine against a one-process run of the same model and global batch (fp32, 1e-5):
every schedule, PP x DP with ZeRO-1/2, tied weights, clipping over all stages, resume at another
pipeline depth, DeepSpeed's example script; and the one-line errors of impossible pipelines."""

from __future__ import annotations

import json

import pytest
import torch

from deepfleet.engine.config import ConfigError
from tests.engine.pipe import pipe_runs as R
from tests.spawn import spawn

TOL = 1e-5
STEPS, MICRO, GAS = 3, 2, 4


def _check(results: list[dict], ref: tuple[list[float], dict]) -> None:
    ref_losses, ref_weights = ref
    seen: set[str] = set()
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=TOL)
        for name, value in r["weights"].items():
            torch.testing.assert_close(value, ref_weights[name], atol=TOL, rtol=0, msg=name)
            seen.add(name)
    assert seen == set(ref_weights)  # the stages together hold every parameter of the model


CASES = [  # (schedule, ZeRO stage, gradient_clipping, PipelineModule kwargs)
    ("GPipe", 0, 0.0, {}),
    ("1F1B", 1, 0.0, {"activation_checkpoint_interval": 2}),  # checkpointed runs of 2 layers per stage
    ("1F1B", 2, 0.2, {}),
    ("Interleaved1F1B", 2, 0.0, {}),
    ("InterleavedZeroBubble", 1, 0.0, {}),
    ("ZBV", 0, 0.2, {}),
    ("DualPipeV", 1, 0.0, {"partition_method": "parameters"}),
]


def test_every_schedule_matches_one_process() -> None:
    cases = [dict(pp=2, schedule=s, stage=z, steps=STEPS, micro=MICRO, gas=GAS, clip=c, model_kwargs=k)
             for s, z, c, k in CASES]
    per_rank = spawn(R.train_cases, 2, cases, timeout=240)
    for i, (schedule, stage, clip, _) in enumerate(CASES):
        results = [per_rank[r][i] for r in range(2)]
        _check(results, R.reference(STEPS, batch=MICRO * GAS, clip=clip))
        if clip:  # the norm before clipping is over every stage's gradients, the same on every rank
            assert results[0]["norm"] == pytest.approx(results[1]["norm"], abs=1e-6)
        # the tied projection is one weight: both stages' copies are equal (and equal the reference)
        copies = [r["weights"]["tied_modules.proj.weight"] for r in results if "tied_modules.proj.weight" in r["weights"]]
        assert len(copies) == (1 if schedule in ("ZBV", "DualPipeV") else 2), (schedule, stage)
        assert all(torch.equal(c, copies[0]) for c in copies)
        assert [r["first"] for r in results] == [True, False]
        # eval_batch after training: the one-process forward loss of the final weights, on every rank
        if schedule in ("ZBV", "DualPipeV"):
            assert all(r["eval"].startswith(f"eval_batch: pipeline.schedule {schedule} (V layout)") for r in results)
            continue
        assert [r["eval"] for r in results] == pytest.approx([R.eval_reference(R.reference(STEPS, batch=MICRO * GAS,
                                                                                          clip=clip)[1])] * 2, abs=TOL)


@pytest.mark.slow
def test_pp_times_dp_with_zero_matches_one_process() -> None:
    cases = [dict(pp=2, schedule=s, stage=z, steps=STEPS, micro=MICRO, gas=GAS) for s, z in
             [("1F1B", 1), ("GPipe", 2), ("ZBV", 1), ("Interleaved1F1B", 0)]]
    per_rank = spawn(R.train_cases, 4, cases, timeout=400)
    for i in range(len(cases)):
        _check([per_rank[r][i] for r in range(4)], R.reference(STEPS, batch=MICRO * GAS * 2))


def test_resume_at_another_pipeline_depth(tmp_path) -> None:
    save = dict(pp=2, schedule="1F1B", stage=1, micro=2, gas=4)
    resume = dict(pp=1, schedule="1F1B", stage=1, micro=2, gas=2)  # dp 2: the same global batch of 8
    results = spawn(R.save_then_resume, 2, save, resume, str(tmp_path), STEPS, timeout=240)
    ref = R.reference(STEPS, batch=8)
    _check(results, ref)
    assert [r["step"] for r in results] == [STEPS, STEPS]


def _example(rank: int, world_size: int, config_path: str) -> list[float]:
    from examples.pipeline.train import main

    return main(["--deepspeed_config", config_path, "-p", "2", "-s", "6"])


@pytest.mark.slow
def test_deepspeed_pipeline_example_runs(tmp_path) -> None:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 100,
        "optimizer": {"type": "Adam", "params": {"lr": 0.003, "betas": [0.9, 0.999], "eps": 1e-8}},
        "zero_optimization": {"stage": 1},
    }))
    losses = spawn(_example, 2, str(config), timeout=240)
    assert losses[0] == losses[1]  # the mean loss reaches every stage
    # cross-entropy over 10 classes from a freshly initialized network: about ln(10) = 2.30
    assert len(losses[0]) == 6 and all(1.5 < x < 3.5 for x in losses[0])
    assert len(set(losses[0])) == 6  # every step trains on new data and new weights


# --- impossible pipelines: one-line errors ---------------------------------------------------------------

def test_more_stages_than_layers_is_one_line_error() -> None:
    with pytest.raises(ValueError, match=r"^num_stages: 8 pipeline parts but only 6 layers; .*") as e:
        R.make_model(8)
    assert "\n" not in str(e.value)


def test_micro_batches_that_do_not_divide_the_batch_are_one_line_error() -> None:
    from deepfleet.engine.engine import initialize

    cfg = {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD",
           "params": {"lr": 0.1}}}
    with pytest.raises(ConfigError) as e:
        initialize(model=R.make_model(1), config=cfg)
    assert e.value.errors == [
        "train_batch_size: 10 is not divisible by 4 (micro) * 1 (data-parallel size) = 4; "
        "use a multiple of 4 or set gradient_accumulation_steps"
    ]


@pytest.mark.parametrize(("changes", "message"), [
    ({"zero_optimization": {"stage": 3}}, "zero_optimization.stage: 3 with pipeline parallelism is not supported"),
    ({"pipeline": {"schedule": "ZBV"}}, "pipeline.schedule: ZBV runs 2 chunk(s) per rank (v layout)"),
    ({"pipeline": {"stages": 2}}, "pipeline.stages: 2 but the PipelineModule has num_stages=1"),
    ({"pipeline": {"schedule": "Zigzag"}}, "pipeline.schedule: unknown schedule 'Zigzag'"),
])
def test_unsupported_pipelines_are_one_line_errors(changes: dict, message: str) -> None:
    from deepfleet.engine.engine import initialize

    cfg = {**R.config(micro=2, gas=2), **changes}
    with pytest.raises(ConfigError) as e:
        initialize(model=R.make_model(1), config=cfg)
    assert len(e.value.errors) == 1 and e.value.errors[0].startswith(message)


# --- partitioning ----------------------------------------------------------------------------------------

def test_partition_methods() -> None:
    from deepfleet.engine.pipe.partition import layer_weights, partition

    assert partition(7, 3, None) == [0, 3, 5, 7]  # uniform: sizes differ by at most one
    assert partition(6, 2, [10, 1, 1, 1, 1, 10]) == [0, 3, 6]  # balanced weights: 12 | 12
    assert partition(4, 2, [100, 1, 1, 1]) == [0, 1, 4]  # the heavy layer alone
    names = ["Embed", "Block", "Block", "Block", "Block", "Head"]
    weights = layer_weights("type:^block$", names=names, param_counts=list, times=list)
    assert weights == [0, 1, 1, 1, 1, 0] and partition(6, 2, weights) == [0, 3, 6]
    with pytest.raises(ValueError, match="^partition_method: 'type:attn' matches none of the layer types"):
        layer_weights("type:attn", names=names, param_counts=list, times=list)
    with pytest.raises(ValueError, match="^partition_method: unknown method 'best'"):
        layer_weights("best", names=names, param_counts=list, times=list)


def test_partition_by_parameters_and_by_measured_time() -> None:
    model = R.make_model(1, tied=False, partition_method="parameters")
    assert model.parts == [0, 6]
    by_params = R.PipelineModule(R.layers(tied=False), num_stages=1, partition_method="parameters")
    assert by_params._count_params() == [128, 272, 272, 272, 272, 136]
    profiled = R.PipelineModule(R.layers(tied=False), num_stages=1, partition_method="profile",
                                profile_input=torch.randn(4, R.DIM))
    assert profiled.parts == [0, 6]
    with pytest.raises(ValueError, match="^profile_input: partition_method='profile' needs"):
        R.PipelineModule(R.layers(tied=False), num_stages=1, partition_method="profile")


def test_batch_arithmetic_leaves_the_pipeline_stages_out_of_data_parallelism() -> None:
    from deepfleet.engine.config import load_config

    # what job-spec validation runs (no process group): 4 ranks, 2 stages -> data-parallel size 2
    cfg = load_config({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": 2}},
                      world_size=4)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (16, 4)
    assert load_config({"train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": "auto"}}).pipeline.stages is None
