"""The `progressive_layer_drop` and (legacy, top-level) `curriculum_learning` sections, with DeepSpeed's
keys and defaults; the schedules themselves are `deepfleet.engine.curriculum`. Torch-free."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from deepfleet.engine.config_base import Bool, ConfigSection, Float, Int


class ProgressiveLayerDropConfig(ConfigSection):
    """`progressive_layer_drop`: the keep probability theta(t) = (1 - theta) * exp(-gamma * t) + theta, passed
    to the model's forward as `progressive_layer_drop=True, pld_theta=theta(t)` (the model drops layers)."""

    enabled: Bool = False
    """Pass the layer-drop schedule to the model's forward."""
    theta: Float = Field(1.0, gt=0.0, le=1.0)
    """The keep probability the schedule decays to (theta-bar)."""
    gamma: Float = Field(0.001, ge=0.0)
    """The decay rate per optimizer step."""


class CurriculumScheduleConfig(ConfigSection):
    """`curriculum_learning.schedule_config`: the keys each `schedule_type` reads."""

    total_curriculum_step: Int | None = Field(None, gt=0)
    """fixed_linear/fixed_root: steps from min to max difficulty."""
    difficulty_step: Int | None = Field(None, gt=0)
    """fixed_linear/fixed_root: every difficulty is a multiple of this (8 for fp16 sequence lengths)."""
    root_degree: Int | None = Field(None, gt=0)
    """fixed_root: the root's degree (2: square root)."""
    difficulty: list[Int] | None = None
    """fixed_discrete: the difficulties, in order."""
    max_step: list[Int] | None = None
    """fixed_discrete: the last step of each difficulty but the final one (one fewer than `difficulty`)."""


class CurriculumLearningConfig(ConfigSection):
    """Top-level `curriculum_learning` (DeepSpeed's legacy curriculum): the current difficulty is passed to
    the model's forward as `curriculum_seqlen=<n>` (the model truncates its sequences to it)."""

    enabled: Bool = False
    """Pass the curriculum difficulty to the model's forward."""
    curriculum_type: Literal["seqlen"] = "seqlen"
    """What the difficulty is: the sequence length."""
    min_difficulty: Int | None = Field(None, gt=0)
    """The first difficulty."""
    max_difficulty: Int | None = Field(None, gt=0)
    """The last difficulty."""
    schedule_type: Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"] | None = None
    """How the difficulty grows with the optimizer step ("custom": `engine.set_custom_curriculum_learning_schedule`)."""
    schedule_config: CurriculumScheduleConfig = Field(default_factory=CurriculumScheduleConfig)
    """The schedule's parameters."""

    @model_validator(mode="after")
    def _complete(self) -> CurriculumLearningConfig:
        if self.enabled:
            check_schedule(self)
        return self


def check_schedule(section: Any) -> None:
    """The keys a curriculum schedule needs (`min_difficulty`, `max_difficulty`, `schedule_type` and the
    type's `schedule_config` entries) are present and consistent; ValueError names the missing ones."""
    missing = [k for k in ("min_difficulty", "max_difficulty", "schedule_type") if getattr(section, k) is None]
    needs = {"fixed_linear": ("total_curriculum_step", "difficulty_step"),
             "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
             "fixed_discrete": ("difficulty", "max_step"), "custom": ()}
    missing += [f"schedule_config.{k}" for k in needs.get(section.schedule_type or "custom", ())
                if getattr(section.schedule_config, k) is None]
    if missing:
        raise ValueError(f"enabled needs {', '.join(missing)}; add them")
    sc = section.schedule_config
    if section.schedule_type == "fixed_discrete" and len(sc.difficulty) != len(sc.max_step) + 1:
        raise ValueError("schedule_config.difficulty: needs one more entry than schedule_config.max_step "
                         "(the last difficulty holds after the last max_step)")
    if section.min_difficulty > section.max_difficulty:
        raise ValueError(f"min_difficulty: {section.min_difficulty} is above max_difficulty {section.max_difficulty}")


class EigenvalueConfig(ConfigSection):
    """`eigenvalue`: the dominant eigenvalue of each block's loss Hessian, by power iteration on
    Hessian-vector products, at every `gas_boundary_resolution`-th accumulation boundary
    (`deepfleet.engine.eigenvalue`). DeepSpeed computed it to drive its quantization schedule; here it
    is a curvature figure per block on `engine.block_eigenvalue` and in the step metrics."""

    enabled: Bool = False
    """Compute the block eigenvalues."""
    verbose: Bool = False
    """Log each block's eigenvalue and iteration count on rank 0."""
    max_iter: Int = Field(100, gt=0)
    """Power iterations per block at most."""
    tol: Float = Field(1e-2, gt=0.0)
    """Stop when the relative change of the estimate between two iterations is below this."""
    stability: Float = Field(1e-6, ge=0.0)
    """Added to vector norms before dividing (keeps a zero Hessian-vector product finite)."""
    gas_boundary_resolution: Int = Field(1, gt=0)
    """Compute at every n-th optimizer step's accumulation boundary."""
    layer_name: str = "bert.encoder.layer"
    """Dotted path of the block list in the model. DeepSpeed's default; when the model has no such
    submodule, the engine's own block discovery (`deepfleet.engine.blocks.blocks`) is used."""
    layer_num: Int = Field(0, ge=0)
    """Blocks to compute, from the first; 0 = every block of the list."""
