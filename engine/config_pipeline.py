"""The `pipeline` config section: DeepSpeed's pipeline keys plus the schedule choice.

Read by `engine/pipe/engine.py` (schedule, activation checkpointing) and by `engine/parallel.py`
through `DEGREE_KEYS` (`pipeline.stages` is the `pp` degree). Torch-free, like every `config_*` module.

DeepSpeed's keys keep its defaults: `stages` ("auto": the number of stages comes from the
`PipelineModule(num_stages=...)`), `partition` ("best"), `seed_layers`, `activation_checkpoint_interval`,
`pipe_partitioned`, `grad_partitioned`. DeepSpeed has one schedule (its own 1F1B); `schedule` is
deepfleet's own key choosing among torch.distributed.pipelining's schedules. `pipe_partitioned` and
`grad_partitioned` split activations and gradients sent between stages over tensor-parallel ranks in
DeepSpeed; without tensor parallelism they change nothing, and they are accepted as such.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from deepfleet.engine.config_base import Bool, ConfigSection, Int

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBV", "DualPipeV")
"""Schedule names accepted by `pipeline.schedule` (torch.distributed.pipelining's schedules)."""

# schedule -> (model chunks per rank: None = any >= 2, chunk layout "loop" or "v")
SCHEDULE_CHUNKS: dict[str, tuple[int | None, str]] = {
    "GPipe": (1, "loop"),
    "1F1B": (1, "loop"),
    "Interleaved1F1B": (None, "loop"),
    "InterleavedZeroBubble": (None, "loop"),
    "ZBV": (2, "v"),
    "DualPipeV": (2, "v"),
}


class PipelineConfig(ConfigSection):
    """`pipeline`: pipeline-parallel training of a `PipelineModule` (engine/pipe/)."""

    stages: Int | Literal["auto"] | None = None
    """Pipeline stages (the `pp` degree); "auto" or None takes `PipelineModule(num_stages=...)`."""
    partition: str = "best"
    """DeepSpeed's key; the partitioning is the module's `partition_method`."""
    seed_layers: Bool = False
    """DeepSpeed's key: seed each layer's initialization by its index (PipelineModule's seed_layers)."""
    activation_checkpoint_interval: Int = Field(0, ge=0)
    """Checkpoint every this many layers of a stage (0: off); overrides the module's when non-zero."""
    pipe_partitioned: Bool = True
    """DeepSpeed's key (activations split over tensor-parallel ranks): no effect without tensor parallelism."""
    grad_partitioned: Bool = True
    """DeepSpeed's key (gradients split over tensor-parallel ranks): no effect without tensor parallelism."""
    use_reentrant: Bool = False
    """Activation checkpointing through torch.utils.checkpoint's reentrant variant."""
    schedule: str | None = None
    """deepfleet's key: one of SCHEDULES; None takes the module's `schedule`, else 1F1B."""

    @field_validator("stages")
    @classmethod
    def _stages(cls, value: int | str | None) -> int | None:
        if value == "auto" or value is None:
            return None
        if value < 1:
            raise ValueError(f"must be a positive integer or \"auto\", got {value}")
        return value

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: str | None) -> str | None:
        if value is not None and value not in SCHEDULES:
            raise ValueError(f"unknown schedule {value!r}; use one of {', '.join(SCHEDULES)}")
        return value
