"""Schedules the engine passes to the model's forward, DeepSpeed's way: progressive layer drop
(`progressive_layer_drop=True, pld_theta=...`) and the legacy sequence-length curriculum
(`curriculum_seqlen=...`). Built by `engine.initialize` from the `progressive_layer_drop` and top-level
`curriculum_learning` sections (engine/config_curriculum.py); `DeepFleetEngine.forward` adds their
keyword arguments, and the boundary step advances them. The curriculum's state is part of checkpoints.
Torch-free arithmetic; written here because torch has neither.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


class ProgressiveLayerDrop:
    """theta(t) = (1 - theta) * exp(-gamma * t) + theta after t optimizer steps (1.0 before the first)."""

    def __init__(self, *, theta: float, gamma: float) -> None:
        self.theta, self.gamma = theta, gamma
        self.current_theta = 1.0

    def update_state(self, global_step: int) -> None:
        self.current_theta = (1.0 - self.theta) * math.exp(-self.gamma * global_step) + self.theta

    def get_theta(self) -> float:
        return self.current_theta

    def get_state(self) -> dict[str, Any]:
        """The keyword arguments the model's forward receives."""
        return {"progressive_layer_drop": True, "pld_theta": self.current_theta}


class CurriculumScheduler:
    """The difficulty after `global_steps` optimizer steps for DeepSpeed's schedule types:
    fixed_linear/fixed_root: ``floor((s / total) ** (1 / degree) * (max - min) + min)`` rounded down to a
    multiple of `difficulty_step`, never below the first such multiple at or above min, never above max;
    fixed_discrete: `difficulty[i]` while `s <= max_step[i]`, the last one after; custom: a user function.
    The difficulty never decreases once max is reached (as DeepSpeed's `update_difficulty`)."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.current_difficulty = int(config.min_difficulty)
        self.custom_get_difficulty: Callable[[int], int] | None = None

    def _fixed_root(self, global_steps: int, degree: int) -> int:
        c, sc = self.config, self.config.schedule_config
        fraction = (global_steps / sc.total_curriculum_step) ** (1.0 / degree)
        value = math.floor(fraction * (c.max_difficulty - c.min_difficulty) + c.min_difficulty)
        value -= value % sc.difficulty_step
        first = -(-c.min_difficulty // sc.difficulty_step) * sc.difficulty_step
        return min(max(value, first), c.max_difficulty)

    def get_difficulty(self, global_steps: int) -> int:
        kind, sc = self.config.schedule_type, self.config.schedule_config
        if kind == "fixed_linear":
            return self._fixed_root(global_steps, 1)
        if kind == "fixed_root":
            return self._fixed_root(global_steps, sc.root_degree)
        if kind == "fixed_discrete":
            for difficulty, last in zip(sc.difficulty, sc.max_step, strict=False):
                if global_steps <= last:
                    return difficulty
            return sc.difficulty[-1]
        if self.custom_get_difficulty is None:
            raise ValueError("curriculum_learning.schedule_type: custom needs "
                             "engine.set_custom_curriculum_learning_schedule(fn) before training")
        return int(self.custom_get_difficulty(global_steps))

    def update_difficulty(self, global_steps: int) -> int:
        if self.current_difficulty < self.config.max_difficulty:
            self.current_difficulty = self.get_difficulty(global_steps)
        return self.current_difficulty

    def get_current_difficulty(self) -> int:
        return self.current_difficulty

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        self.custom_get_difficulty = schedule_function

    def state_dict(self) -> dict[str, Any]:
        return {"current_difficulty": self.current_difficulty}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current_difficulty = int(state["current_difficulty"])


class ModelSchedules:
    """What the engine holds: the enabled schedules, the forward keywords they add, their per-step update and
    their checkpoint state (`engine.model_schedules`)."""

    def __init__(self, config: Any) -> None:
        pld, cl = config.progressive_layer_drop, config.curriculum_learning
        self.progressive_layer_drop = ProgressiveLayerDrop(theta=pld.theta, gamma=pld.gamma) if pld.enabled else None
        self.curriculum = CurriculumScheduler(cl) if cl.enabled else None
        self.random_ltd = None  # engine/data_routing.py's RandomLTDScheduler, set by the engine when configured

    def forward_kwargs(self, *, next_step: int, training: bool) -> dict[str, Any]:
        """Keywords for the model's forward on a training micro-batch of optimizer step `next_step`
        (1-based); evaluation forwards (`training` False) get none, as in DeepSpeed."""
        extra: dict[str, Any] = {}
        if not training:
            return extra
        if self.random_ltd is not None:  # the kept length of this step (steps taken so far)
            self.random_ltd.update_seq(next_step - 1)
        if self.progressive_layer_drop is not None:
            extra.update(self.progressive_layer_drop.get_state())
        if self.curriculum is not None:
            difficulty = self.curriculum.update_difficulty(next_step)
            if self.curriculum.config.curriculum_type == "seqlen":  # the one type DeepSpeed's legacy form has
                extra["curriculum_seqlen"] = difficulty
        return extra

    def step_done(self, global_steps: int) -> None:
        if self.progressive_layer_drop is not None:
            self.progressive_layer_drop.update_state(global_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"curriculum": self.curriculum.state_dict() if self.curriculum is not None else None,
                "pld_theta": self.progressive_layer_drop.current_theta if self.progressive_layer_drop else None,
                "random_ltd": self.random_ltd.state_dict() if self.random_ltd is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.curriculum is not None and state.get("curriculum") is not None:
            self.curriculum.load_state_dict(state["curriculum"])
        if self.progressive_layer_drop is not None and state.get("pld_theta") is not None:
            self.progressive_layer_drop.current_theta = float(state["pld_theta"])
        if self.random_ltd is not None and state.get("random_ltd") is not None:
            self.random_ltd.load_state_dict(state["random_ltd"])
