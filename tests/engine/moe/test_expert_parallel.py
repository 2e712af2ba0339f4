"""Expert parallelism on 2 gloo ranks: ep_size 2 trains exactly like ep_size 1 over the same experts at
ZeRO stages 0-3 (losses, aux losses, gradient norms, expert counts and parameters after 5 steps of 2
micro-steps), each rank holds its own experts under global names, a run resumes at another ep_size and
continues the loss curve, and degrees that do not fit are one-line config errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepfleet.engine.config import ConfigError
from tests.engine.moe.moe_runs import parity, resume_run
from tests.spawn import spawn


def _merged(runs: list[dict], key: tuple) -> dict:
    return {name: value for run in runs for name, value in run[key]["params"].items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ep2_equals_ep1(stage: int) -> None:
    runs = parity()
    for rank in range(2):
        one, two = runs[rank][(stage, 1)], runs[rank][(stage, 2)]
        np.testing.assert_allclose(two["losses"], one["losses"], atol=2e-6)
        np.testing.assert_allclose(two["aux"], one["aux"], atol=2e-6)
        np.testing.assert_allclose(two["norms"], one["norms"], rtol=1e-5)
        assert two["counts"] == one["counts"]
    a, b = _merged(runs, (stage, 1)), _merged(runs, (stage, 2))
    assert sorted(a) == sorted(b)
    for name in a:  # AdamW amplifies float noise in near-zero gradients; 5 steps at lr 3e-3
        np.testing.assert_allclose(b[name], a[name], atol=5e-4, err_msg=name)
    # the loss fell: the runs train
    assert np.mean(runs[0][(stage, 2)]["losses"][-2:]) < np.mean(runs[0][(stage, 2)]["losses"][:2])


def test_each_rank_holds_its_experts_under_global_ids() -> None:
    runs = parity()
    assert runs[0][(0, 2)]["experts_held"] == ["0", "1"]
    assert runs[1][(0, 2)]["experts_held"] == ["2", "3"]
    assert runs[1][(0, 1)]["experts_held"] == ["0", "1", "2", "3"]
    expert_keys = [k for k in runs[1][(0, 2)]["params"] if "deepspeed_experts" in k]
    assert expert_keys and all(".deepspeed_experts.2." in k or ".deepspeed_experts.3." in k for k in expert_keys)


def test_resume_at_another_ep_size_continues_the_loss_curve(tmp_path) -> None:
    resumed = spawn(resume_run, 2, str(tmp_path), timeout=300)
    runs = parity()
    for rank in range(2):
        for (stage, first, then), run in resumed[rank].items():
            uninterrupted = runs[rank][(stage, first)]["losses"]
            assert run["global_steps"] == 5
            np.testing.assert_allclose(run["losses"], uninterrupted, atol=2e-5, err_msg=f"{stage} {first}->{then}")


def _bad_degree(rank: int, world_size: int, ep_size: int, section: dict | None) -> str:
    import deepfleet.engine as deepspeed
    from examples.gpt.moe_model import MoEArgs, MoEGPTWithLoss
    from tests.engine.moe.moe_runs import MODEL, config

    model = MoEGPTWithLoss(MODEL, MoEArgs(num_experts=6, ep_size=ep_size))
    try:
        deepspeed.initialize(model=model, config=config(0, **({"moe": section} if section else {})))
    except ConfigError as e:
        return str(e)
    return "no error"


def test_ep_size_not_dividing_world_size_is_a_one_line_config_error() -> None:
    messages = spawn(_bad_degree, 2, 3, None)
    assert messages[0] == messages[1]
    assert "\n" not in messages[0] and messages[0].startswith("MoE(ep_size=...): 3 does not divide the data-parallel size 2")


def test_moe_ep_size_must_agree_with_the_layers() -> None:
    messages = spawn(_bad_degree, 2, 2, {"num_experts": 6, "ep_size": 3})
    assert messages[0].startswith("moe.ep_size: 3 but the model's MoE layers use ep_size 2")


def test_ep_size_not_dividing_num_experts_is_an_error() -> None:
    from deepfleet.engine.config import load_config
    from deepfleet.engine.moe.layer import MoE

    with pytest.raises(ConfigError) as info:
        load_config({"train_micro_batch_size_per_gpu": 1, "moe": {"num_experts": 6, "ep_size": 4}})
    assert str(info.value).count("\n") == 0 and "moe.ep_size: 4 does not divide num_experts 6" in str(info.value)
    with pytest.raises(ValueError, match="num_experts: 6 is not a multiple of ep_size 4"):
        MoE(8, torch.nn.Linear(8, 8), num_experts=6, ep_size=4)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_ep2_equals_ep1_on_4_ranks(stage: int) -> None:
    from tests.engine.moe.moe_runs import parity4

    runs = parity4()
    for rank in range(4):
        one, two = runs[rank][(stage, 1)], runs[rank][(stage, 2)]
        np.testing.assert_allclose(two["losses"], one["losses"], atol=2e-6)
        np.testing.assert_allclose(two["norms"], one["norms"], rtol=1e-5)
    assert runs[2][(stage, 2)]["experts_held"] == ["0", "1"] and runs[3][(stage, 2)]["experts_held"] == ["2", "3"]
    a, b = _merged(runs, (stage, 1)), _merged(runs, (stage, 2))
    for name in a:
        np.testing.assert_allclose(b[name], a[name], atol=5e-4, err_msg=name)


@pytest.mark.slow
def test_resume_at_another_world_size_and_ep_size(tmp_path) -> None:
    """Saved on 2 ranks at ep_size 2, resumed on 4 ranks at ep_size 4 (and back on 2 at ep_size 1), the
    global-batch loss follows the uninterrupted 2-rank run."""
    from tests.engine.moe.moe_runs import world_run

    whole = spawn(world_run, 2, str(tmp_path / "whole"), (0, 5), 2)[0]["step_losses"]
    ckpt = str(tmp_path / "moving")
    first = spawn(world_run, 2, ckpt, (0, 2), 2)[0]
    wide = spawn(world_run, 4, ckpt, (2, 4), 4)[0]
    back = spawn(world_run, 2, ckpt, (4, 5), 1)[0]
    assert back["global_steps"] == 5
    np.testing.assert_allclose(first["step_losses"] + wide["step_losses"] + back["step_losses"], whole, atol=5e-5)
