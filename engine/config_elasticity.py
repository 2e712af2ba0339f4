"""The `elasticity` section (DeepSpeed Elasticity): instead of fixed batch sizes, a largest global batch and
the micro-batch sizes a job may use; `deepfleet.engine.elasticity` picks a global batch that divides
well over many data-parallel sizes, and each run's micro-batch and accumulation steps for its size, so a
job can be restarted on another number of ranks (the worker's elastic restarts) with the same global
batch. Torch-free."""

from __future__ import annotations

from pydantic import Field, model_validator

from deepfleet.engine.config_base import Bool, ConfigSection, Float, Int


class ElasticityConfig(ConfigSection):
    """`elasticity`, DeepSpeed's keys and defaults."""

    enabled: Bool = False
    """Let the elastic computation set train_batch_size, the micro-batch size and accumulation steps."""
    max_train_batch_size: Int = Field(2000, gt=0)
    """The largest global batch the job accepts."""
    micro_batch_sizes: list[Int] = Field(default_factory=lambda: [2, 4, 6], min_length=1)
    """Micro-batch sizes a rank may run (the largest that fits the chosen batch at a size is used)."""
    min_gpus: Int = Field(1, gt=0)
    """The fewest ranks (version 0.2: ranks, counted in whole nodes) the batch must suit."""
    max_gpus: Int = Field(10000, gt=0)
    """The most ranks the batch must suit."""
    min_time: Int = Field(0, ge=0)
    """Minutes a scheduler should keep a job at one size before rescaling it (read by schedulers only)."""
    version: Float = 0.2
    """0.1: sizes counted in ranks; 0.2: in nodes of `num_gpus_per_node` ranks, with model parallelism."""
    prefer_larger_batch: Bool = True
    """Between batches that suit as many sizes, take the larger (and the larger micro-batch)."""
    ignore_non_elastic_batch_info: Bool = False
    """Allow train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps in the config
    (they are overridden); otherwise they are an error, as in DeepSpeed."""
    num_gpus_per_node: Int = Field(1, gt=0)
    """Version 0.2: ranks per node."""
    model_parallel_size: Int = Field(1, gt=0)
    """Version 0.2: ranks per model replica (tensor/pipeline parallel); must divide num_gpus_per_node."""

    @model_validator(mode="after")
    def _consistent(self) -> ElasticityConfig:
        if self.enabled:
            if self.version not in (0.1, 0.2):
                raise ValueError(f"version: {self.version} unknown; use 0.1 or 0.2")
            if self.min_gpus > self.max_gpus:
                raise ValueError(f"min_gpus: {self.min_gpus} is above max_gpus {self.max_gpus}")
            too_big = [m for m in self.micro_batch_sizes if m > self.max_train_batch_size or m < 1]
            if too_big:
                raise ValueError(f"micro_batch_sizes: {too_big} outside 1..max_train_batch_size "
                                 f"{self.max_train_batch_size}")
            if self.model_parallel_size > 1 and self.version != 0.2:
                raise ValueError("model_parallel_size: needs version 0.2")
            if self.num_gpus_per_node % self.model_parallel_size:
                raise ValueError(f"num_gpus_per_node: {self.num_gpus_per_node} is not a multiple of "
                                 f"model_parallel_size {self.model_parallel_size}")
        return self
