"""deepfleet.engine.lr_schedules: DeepSpeed's schedules, checked step by step against hand-computed rates."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from deepfleet.engine.config import load_config
from deepfleet.engine.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)

torch.set_num_threads(1)


def _optimizer(*lrs: float, kind=torch.optim.AdamW) -> torch.optim.Optimizer:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return kind(groups, lr=lrs[0])


def _lrs_by_iteration(sched, iterations: int) -> dict[int, list[float]]:
    """{last_batch_iteration: group lrs}, from the current iteration (-1 when fresh) for `iterations` steps."""
    start = sched.last_batch_iteration
    out = {start: [g["lr"] for g in sched.optimizer.param_groups]}
    for i in range(start + 1, start + 1 + iterations):
        sched.optimizer.step()  # no grads: a no-op, keeps torch's "optimizer.step() first" order
        sched.step()
        assert sched.last_batch_iteration == i
        out[i] = [g["lr"] for g in sched.optimizer.param_groups]
        assert sched.get_last_lr() == out[i]
    return out


def test_warmup_lr_log_and_linear() -> None:
    log = _lrs_by_iteration(WarmupLR(_optimizer(1.0), warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10), 12)
    assert log[-1] == [0.0] and log[0] == [0.0]
    assert log[1][0] == pytest.approx(0.1 * math.log(2) / math.log(10))
    assert log[2][0] == pytest.approx(0.1 * math.log(3) / math.log(10))
    assert log[9][0] == pytest.approx(0.1)  # log(10) / log(10)
    assert log[11] == [0.1]
    lin = _lrs_by_iteration(WarmupLR(_optimizer(1.0), warmup_min_lr=0.02, warmup_max_lr=0.12, warmup_num_steps=10,
                                     warmup_type="linear"), 12)
    assert lin[1][0] == pytest.approx(0.02 + 0.1 * 0.1)
    assert lin[5][0] == pytest.approx(0.07)
    assert lin[10][0] == pytest.approx(0.12) and lin[11][0] == pytest.approx(0.12)


def test_warmup_lr_unset_max_uses_each_groups_own_lr() -> None:
    lrs = _lrs_by_iteration(WarmupLR(_optimizer(0.1, 1.0), warmup_num_steps=4, warmup_type="linear"), 6)
    assert lrs[-1] == [0.0, 0.0]
    assert lrs[2] == pytest.approx([0.05, 0.5])
    assert lrs[5] == pytest.approx([0.1, 1.0])


def test_warmup_decay_lr_decays_linearly_to_zero_at_total_steps() -> None:
    lrs = _lrs_by_iteration(WarmupDecayLR(_optimizer(1.0), total_num_steps=20, warmup_max_lr=0.1,
                                          warmup_num_steps=10, warmup_type="linear"), 26)
    assert lrs[5][0] == pytest.approx(0.05)
    assert lrs[10][0] == pytest.approx(0.1)   # (20 - 10) / (20 - 10)
    assert lrs[15][0] == pytest.approx(0.05)  # (20 - 15) / 10
    assert lrs[19][0] == pytest.approx(0.01)
    assert lrs[20][0] == 0.0 and lrs[25][0] == 0.0


def test_warmup_cosine_lr_ratios_of_each_group() -> None:
    sched = WarmupCosineLR(_optimizer(0.2, 2.0), total_num_steps=12, warmup_num_steps=4, warmup_min_ratio=0.1,
                           cos_min_ratio=0.0, warmup_type="linear")
    lrs = _lrs_by_iteration(sched, 16)
    assert lrs[-1] == pytest.approx([0.02, 0.2])
    assert lrs[0] == pytest.approx([0.02, 0.2])
    assert lrs[2] == pytest.approx([0.2 * 0.55, 2.0 * 0.55])          # 0.1 + 0.9 * 2/4
    assert lrs[4][0] == pytest.approx(0.2 * (1 + math.cos(math.pi / 8)) / 2)       # p = 1/8
    assert lrs[8][0] == pytest.approx(0.2 * (1 + math.cos(5 * math.pi / 8)) / 2)   # p = 5/8
    assert lrs[11] == pytest.approx([0.0, 0.0], abs=1e-15)                         # p = 1
    assert lrs[15] == pytest.approx([0.0, 0.0], abs=1e-15)                         # held at the floor
    floor = _lrs_by_iteration(WarmupCosineLR(_optimizer(1.0), total_num_steps=6, warmup_num_steps=2,
                                             cos_min_ratio=0.25), 10)
    assert floor[9][0] == pytest.approx(0.25)


def test_lr_range_test_continuous_and_staircase() -> None:
    cont = _lrs_by_iteration(LRRangeTest(_optimizer(1.0), lr_range_test_min_lr=0.01, lr_range_test_step_size=4,
                                         lr_range_test_step_rate=0.5), 8)
    assert cont[-1] == [0.01]
    assert cont[2][0] == pytest.approx(0.01 * (1 + 0.5 * 3 / 4))
    assert cont[7][0] == pytest.approx(0.01 * (1 + 0.5 * 2))
    stairs = _lrs_by_iteration(LRRangeTest(_optimizer(1.0), lr_range_test_min_lr=0.01, lr_range_test_step_size=4,
                                           lr_range_test_step_rate=0.5, lr_range_test_staircase=True), 8)
    assert [stairs[i][0] for i in range(-1, 8)] == pytest.approx([0.01] * 4 + [0.015] * 4 + [0.02])


def test_one_cycle_lr_momentum_and_decay() -> None:
    opt = _optimizer(1.0, kind=torch.optim.Adam)
    sched = OneCycle(opt, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4, cycle_second_step_size=6,
                     decay_step_size=2, decay_lr_rate=0.5, decay_mom_rate=0.1)
    assert opt.param_groups[0]["betas"] == pytest.approx((0.9, 0.999))
    moms = {}
    lrs = {-1: opt.param_groups[0]["lr"]}
    for i in range(12):
        opt.step()
        sched.step()
        lrs[i], moms[i] = opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]
    assert lrs[-1] == pytest.approx(0.01)
    assert lrs[1] == pytest.approx(0.055) and moms[1] == pytest.approx((0.85, 0.999))   # b = 2 of 4: half way up
    assert lrs[3] == pytest.approx(0.1) and moms[3] == pytest.approx((0.8, 0.999))      # peak
    assert lrs[6] == pytest.approx(0.055) and moms[6] == pytest.approx((0.85, 0.999))   # b = 7: 3 of 6 left
    assert lrs[9] == pytest.approx(0.01) and moms[9] == pytest.approx((0.9, 0.999))     # end of the cycle
    assert lrs[10] == pytest.approx(0.01 / (1 + 0.5 * 1 / 2))                           # decay, 1 step after
    assert lrs[11] == pytest.approx(0.01 / (1 + 0.5 * 2 / 2))
    assert moms[11] == pytest.approx((0.9 * (1 + 0.1 * 2 / 2), 0.999))


def test_one_cycle_stairs_and_sgd_momentum() -> None:
    opt = _optimizer(1.0, kind=torch.optim.SGD)
    opt.param_groups[0]["momentum"] = 0.9
    sched = OneCycle(opt, cycle_min_lr=0.0, cycle_max_lr=1.0, cycle_first_step_size=4, cycle_first_stair_count=2)
    lrs = _lrs_by_iteration(sched, 8)
    assert [lrs[i][0] for i in range(-1, 8)] == pytest.approx([0, 0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0])
    assert opt.param_groups[0]["momentum"] == pytest.approx(0.9)  # scale 0 at iteration 7 -> max momentum
    no_momentum = OneCycle(_optimizer(1.0, kind=torch.optim.Adagrad), cycle_min_lr=0.1, cycle_max_lr=0.2)
    assert no_momentum.cycle_momentum is False


@pytest.mark.parametrize(
    "section",
    [
        {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 0.3}},
        {"type": "WarmupDecayLR", "params": {"total_num_steps": 9, "warmup_num_steps": 3}},
        {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_num_steps": 3}},
        {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 3}},
        {"type": "LRRangeTest", "params": {"lr_range_test_step_size": 2}},
    ],
)
def test_state_dict_round_trip_continues_the_curve(section: dict) -> None:
    config = load_config({"train_batch_size": 1, "scheduler": section}).scheduler
    opt_a = _optimizer(0.2, 0.4)
    sched_a = build_lr_scheduler(opt_a, config)
    _lrs_by_iteration(sched_a, 4)
    saved_sched, saved_opt = copy.deepcopy(sched_a.state_dict()), copy.deepcopy(opt_a.state_dict())
    opt_b = _optimizer(0.2, 0.4)
    sched_b = build_lr_scheduler(opt_b, config)
    opt_b.load_state_dict(saved_opt)
    sched_b.load_state_dict(saved_sched)
    assert sched_b.last_batch_iteration == 3
    assert _lrs_by_iteration(sched_b, 5) == _lrs_by_iteration(sched_a, 5)


def test_last_batch_iteration_resumes_the_curve() -> None:
    fresh = WarmupLR(_optimizer(1.0), warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")
    reference = _lrs_by_iteration(fresh, 8)
    resumed = WarmupLR(_optimizer(1.0), warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear",
                       last_batch_iteration=5)
    assert resumed.last_batch_iteration == 5
    assert resumed.get_last_lr() == pytest.approx(reference[5])
    resumed.optimizer.step()
    resumed.step()
    assert resumed.get_last_lr() == pytest.approx(reference[6])


def test_build_lr_scheduler_none_and_types() -> None:
    opt = _optimizer(0.1)
    assert build_lr_scheduler(opt, None) is None
    config = load_config({"train_batch_size": 1, "scheduler": {"type": "warmupdecaylr", "params": {
        "total_num_steps": 100, "warmup_num_steps": 10}}}).scheduler
    sched = build_lr_scheduler(opt, config)
    assert type(sched) is WarmupDecayLR and sched.total_num_steps == 100 and sched.warmup_num_steps == 10
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)


def test_per_group_rates_as_lists() -> None:
    config = load_config({"train_batch_size": 1, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": [0.0, 0.01], "warmup_max_lr": [0.1, 1.0], "warmup_num_steps": 4,
        "warmup_type": "linear"}}}).scheduler
    lrs = _lrs_by_iteration(build_lr_scheduler(_optimizer(0.5, 0.5), config), 5)
    assert lrs[-1] == [0.0, 0.01]
    assert lrs[2] == pytest.approx([0.05, 0.01 + 0.99 * 0.5])
    assert lrs[4] == pytest.approx([0.1, 1.0])
    with pytest.raises(ValueError, match="warmup_min_lr: 2 values for 3 param groups"):
        build_lr_scheduler(_optimizer(0.5, 0.5, 0.5), config)
    stairs = LRRangeTest(_optimizer(1.0, 1.0), lr_range_test_min_lr=[0.01, 0.1], lr_range_test_step_size=2,
                         lr_range_test_staircase=True)
    assert _lrs_by_iteration(stairs, 2)[1] == pytest.approx([0.02, 0.2])
