"""Progressive layer drop and the legacy sequence-length curriculum: DeepSpeed's schedules, passed to the
model's forward as keywords, advanced per optimizer step, and carried by checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import deepfleet.engine as deepspeed
from deepfleet.engine.config import ConfigError, load_config
from deepfleet.engine.curriculum import CurriculumScheduler

pytestmark = pytest.mark.usefixtures("one_rank_group")


def _scheduler(**section) -> CurriculumScheduler:
    cfg = load_config({"train_batch_size": 1, "curriculum_learning": {"enabled": True, **section}})
    return CurriculumScheduler(cfg.curriculum_learning)


def test_fixed_linear_root_and_discrete_follow_deepspeeds_rules() -> None:
    linear = _scheduler(min_difficulty=8, max_difficulty=64, schedule_type="fixed_linear",
                        schedule_config={"total_curriculum_step": 10, "difficulty_step": 8})
    # floor(s/10 * 56 + 8) rounded down to a multiple of 8, capped at 64
    assert [linear.get_difficulty(s) for s in (1, 2, 5, 10, 20)] == [8, 16, 32, 64, 64]
    root = _scheduler(min_difficulty=8, max_difficulty=64, schedule_type="fixed_root",
                      schedule_config={"total_curriculum_step": 16, "difficulty_step": 8, "root_degree": 2})
    expected = [min(64, max(8, (v := math.floor(math.sqrt(s / 16) * 56 + 8)) - v % 8)) for s in (1, 4, 9, 16)]
    assert [root.get_difficulty(s) for s in (1, 4, 9, 16)] == expected == [16, 32, 48, 64]
    discrete = _scheduler(min_difficulty=1, max_difficulty=3, schedule_type="fixed_discrete",
                          schedule_config={"difficulty": [1, 2, 3], "max_step": [2, 4]})
    assert [discrete.get_difficulty(s) for s in range(1, 7)] == [1, 1, 2, 2, 3, 3]
    # a first multiple of difficulty_step above min: never a zero-length sequence
    odd = _scheduler(min_difficulty=8, max_difficulty=64, schedule_type="fixed_linear",
                     schedule_config={"total_curriculum_step": 100, "difficulty_step": 16})
    assert odd.get_difficulty(1) == 16


def test_incomplete_sections_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="curriculum_learning: enabled needs schedule_config.total_curriculum_step"):
        load_config({"train_batch_size": 1, "curriculum_learning": {
            "enabled": True, "min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_linear",
            "schedule_config": {"difficulty_step": 8}}})
    with pytest.raises(ConfigError, match="needs one more entry"):
        load_config({"train_batch_size": 1, "curriculum_learning": {
            "enabled": True, "min_difficulty": 1, "max_difficulty": 3, "schedule_type": "fixed_discrete",
            "schedule_config": {"difficulty": [1, 2], "max_step": [2, 4]}}})


class Recorder(nn.Module):
    """Records the keywords the engine passes and truncates to curriculum_seqlen, as Megatron models do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.seen: list[dict] = []

    def forward(self, x, curriculum_seqlen=None, progressive_layer_drop=False, pld_theta=None):
        self.seen.append({"seqlen": curriculum_seqlen, "pld": progressive_layer_drop, "theta": pld_theta})
        if curriculum_seqlen is not None:
            x = x[:, :curriculum_seqlen]
        return self.lin(x).mean()


def test_engine_passes_the_schedules_and_checkpoints_them(tmp_path) -> None:
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.1},
           "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 2,
                                   "max_difficulty": 8, "schedule_type": "fixed_discrete",
                                   "schedule_config": {"difficulty": [2, 4, 8], "max_step": [1, 2]}}}
    torch.manual_seed(0)
    model = Recorder()
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    x = torch.randn(2, 8, 4)
    for _ in range(3):
        engine.backward(engine(x))
        engine.step()
    assert [s["seqlen"] for s in model.seen] == [2, 4, 8]
    thetas = [s["theta"] for s in model.seen]
    assert thetas[0] == 1.0 and thetas[1] == pytest.approx(0.5 * math.exp(-0.1) + 0.5)
    assert engine.get_pld_theta() == pytest.approx(0.5 * math.exp(-0.3) + 0.5)
    assert engine.curriculum_enabled_legacy() and engine.curriculum_scheduler_legacy.get_current_difficulty() == 8
    engine.eval()
    with torch.no_grad():
        engine(x)
    assert model.seen[-1] == {"seqlen": None, "pld": False, "theta": None}  # evaluation gets no keywords
    engine.train()
    engine.save_checkpoint(tmp_path)
    fresh = Recorder()
    engine2, *_ = deepspeed.initialize(model=fresh, config=cfg)
    engine2.load_checkpoint(tmp_path)
    assert engine2.curriculum_scheduler_legacy.get_current_difficulty() == 8
    assert engine2.get_pld_theta() == pytest.approx(engine.get_pld_theta())
