"""The `checkpoint` and `compile` sections of the engine config (DeepSpeed's keys and defaults). Torch-free.

- `checkpoint.tag_validation` ("Ignore", "Warn" — DeepSpeed's default — or "Fail"): at
  `save_checkpoint` every rank's tag is compared; ranks saving under different tags would write two
  half checkpoints. Read by `deepfleet.engine.checkpoint.api.save_checkpoint`.
- `checkpoint.load_universal`: DeepSpeed's switch to load a "universal" (topology-independent)
  checkpoint. Every checkpoint of this engine is one, so both values load the same way.
- `checkpoint.use_node_local_storage`: DeepSpeed's per-node checkpoint folders on non-shared disks. Not
  supported: a resume here may run at another world size or on other nodes, so shards live in one shared
  directory (only `false` is accepted).
- `checkpoint.parallel_write.pipeline_stage`: how DeepSpeed spreads pipeline stages' writes; every rank
  writes its own shard files here, so both values write the same checkpoint.
- `compile` (`enabled`, `backend`, `kwargs`): `torch.compile` of the wrapped model, as DeepSpeed's
  `engine.compile()` does; applied by `engine.initialize` after the ZeRO strategy has wrapped it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from deepfleet.engine.config_base import Bool, ConfigSection


class ParallelWriteConfig(ConfigSection):
    """`checkpoint.parallel_write`."""

    pipeline_stage: Bool = False
    """DeepSpeed: let every pipeline stage write its own files (each rank always writes its own here)."""


class CheckpointConfig(ConfigSection):
    """The `checkpoint` section."""

    tag_validation: Literal["Ignore", "Warn", "Fail"] = "Warn"
    """Compare the checkpoint tag across ranks at save: do nothing, log a warning, or raise."""
    load_universal: Bool = False
    """Load a topology-independent checkpoint (every checkpoint here is one: both values load alike)."""
    use_node_local_storage: Bool = False
    """Per-node checkpoint folders; only false: shards live in one directory every node can read."""
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    """How stages write in parallel (every rank writes its own shard files here)."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _case_insensitive(cls, value: Any) -> Any:
        # DeepSpeed matches the mode case-insensitively ("warn", "FAIL")
        if isinstance(value, str):
            return {"ignore": "Ignore", "warn": "Warn", "fail": "Fail"}.get(value.lower(), value)
        return value

    @field_validator("use_node_local_storage")
    @classmethod
    def _shared_storage(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "node-local checkpoint storage is not supported (a resume may run on other nodes or at another "
                "world size); set it to false and give checkpoints a directory every node can read"
            )
        return value


class CompileConfig(ConfigSection):
    """The `compile` section: `torch.compile` the wrapped model."""

    enabled: Bool = False
    """Compile the model's forward (and its backward, through AOTAutograd)."""
    backend: str = "inductor"
    """The `torch.compile` backend ("inductor", "aot_eager", "eager", ...)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Further keyword arguments of `torch.compile` (`mode`, `fullgraph`, `dynamic`, `options`)."""


class ThroughputTimerConfig(ConfigSection):
    """`timers.throughput`: the throughput timer behind `engine.tput_timer` (samples per second)."""

    enabled: Bool = True
    """Time the optimizer steps (off: `tput_timer.avg_samples_per_sec()` stays 0)."""
    synchronized: Bool = True
    """Wait for the accelerator's queued work before each reading (exact on a GPU; nothing to wait for on CPU)."""


class TimersConfig(ConfigSection):
    """The `timers` section (DeepSpeed's name)."""

    throughput: ThroughputTimerConfig = Field(default_factory=ThroughputTimerConfig)
    """The throughput timer."""
