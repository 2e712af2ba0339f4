"""The `data_efficiency` section with DeepSpeed's keys and defaults: `data_routing.random_ltd` (random
layerwise token dropping, `deepfleet.engine.data_routing`) and `data_sampling.curriculum_learning`
(curriculum sampling from an offline data-analyzer index, `deepfleet.engine.data_sampling`).
`data_sampling.dynamic_batching` and random-LTD's `layer_token_lr_schedule` (refused by DeepSpeed itself)
are accepted only disabled (`config_keys.NOT_SUPPORTED`). Torch-free."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from deepfleet.engine.config_base import Bool, ConfigSection, Int
from deepfleet.engine.config_curriculum import CurriculumScheduleConfig, check_schedule


class RandomLTDScheduleParams(ConfigSection):
    """`random_ltd_schedule.schedule_config`."""

    require_steps: Int = Field(..., gt=0)
    """Optimizer steps from `min_value` to `max_value` kept tokens."""
    seq_per_step: Int = Field(1, gt=0)
    """The kept length is a multiple of this (8 or 16 for fused kernels)."""


class RandomLTDSchedule(ConfigSection):
    """`random_ltd_schedule`: the kept sequence length grows from `min_value` to `max_value`."""

    min_value: Int = Field(..., gt=0)
    """Tokens kept per sample in the dropping layers at step 0."""
    max_value: Int = Field(..., gt=0)
    """Tokens kept at the end of the schedule (the full sequence length: no dropping from then on)."""
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    """The one schedule DeepSpeed implements."""
    schedule_config: RandomLTDScheduleParams
    """`require_steps` and `seq_per_step`."""

    @model_validator(mode="after")
    def _order(self) -> RandomLTDSchedule:
        if self.min_value > self.max_value:
            raise ValueError(f"min_value: {self.min_value} is above max_value {self.max_value}; swap them")
        return self


class RandomLTDConfig(ConfigSection):
    """`data_efficiency.data_routing.random_ltd`: the listed layers see only a random, order-preserving
    subset of each sequence's tokens; the others pass through them unchanged."""

    enabled: Bool = False
    """Drop tokens in the listed layers."""
    total_layer_num: Int = Field(..., gt=0)
    """Layers (blocks) of the model: counts consumed layer-tokens."""
    random_ltd_layer_num: Int = Field(..., ge=0)
    """How many layers drop tokens (the length of `random_ltd_layer_id`)."""
    random_ltd_layer_id: list[Int]
    """Indices of the dropping layers among the model's blocks."""
    model_mask_name: str | None = None
    """Keyword of the layers' attention mask (cut to the kept tokens); None: the layers take none."""
    model_type: Literal["decoder", "encoder"] = "decoder"
    """decoder: causal masks are cropped; encoder: masks are gathered at the kept positions."""
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] = "batch_seq_dim"
    """Layout of the layers' hidden-state input: (batch, seq, hidden) or (seq, batch, hidden)."""
    random_ltd_schedule: RandomLTDSchedule
    """The kept-length schedule."""

    @model_validator(mode="after")
    def _layers(self) -> RandomLTDConfig:
        if self.random_ltd_layer_num != len(self.random_ltd_layer_id):
            raise ValueError(f"random_ltd_layer_num: {self.random_ltd_layer_num} != len(random_ltd_layer_id) = "
                             f"{len(self.random_ltd_layer_id)}; make them agree")
        bad = [i for i in self.random_ltd_layer_id if not 0 <= i < self.total_layer_num]
        if bad:
            raise ValueError(f"random_ltd_layer_id: {bad} outside 0..{self.total_layer_num - 1} (total_layer_num); "
                             "list block indices of the model")
        return self


class DataRoutingConfig(ConfigSection):
    """`data_efficiency.data_routing`."""

    enabled: Bool = False
    """Routing switch: random-LTD acts only when this and `data_efficiency.enabled` are true."""
    random_ltd: RandomLTDConfig | None = None
    """Random layerwise token dropping."""


class CurriculumMetricConfig(ConfigSection):
    """One entry of `curriculum_learning.curriculum_metrics`: a per-sample metric from the data analyzer
    and how its allowed difficulty grows with the optimizer step."""

    index_to_sample_path: str | None = None
    """Prefix (without .bin/.idx) of the analyzer's `<metric>_index_to_sample` file: one row of sample
    indices per metric value, in ascending value order. Not needed with `clustering_type: single_cluster`."""
    index_to_metric_path: str | None = None
    """Prefix of the analyzer's `<metric>_index_to_metric` file: the value of each row above (value-based
    difficulty only)."""
    difficulty_type: Literal["value", "percentile"] = "value"
    """value: samples whose metric is at most the difficulty; percentile: the easiest `difficulty` percent."""
    clustering_type: Literal["schedule_based", "single_cluster"] = "schedule_based"
    """schedule_based: the metric gates samples; single_cluster: it does not (every sample is eligible)."""
    min_difficulty: Int | None = None
    """The first difficulty (a metric value, or a percentile in 1..100)."""
    max_difficulty: Int | None = None
    """The last difficulty."""
    schedule_type: Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"] | None = None
    """How the difficulty grows with the optimizer step ("custom": `engine.set_custom_curriculum_learning_schedule`)."""
    schedule_config: CurriculumScheduleConfig = Field(default_factory=CurriculumScheduleConfig)
    """The schedule's parameters."""

    @model_validator(mode="after")
    def _complete(self) -> CurriculumMetricConfig:
        check_schedule(self)
        if self.clustering_type == "schedule_based":
            needed = ["index_to_sample_path"] + (["index_to_metric_path"] if self.difficulty_type == "value" else [])
            missing = [k for k in needed if getattr(self, k) is None]
            if missing:
                raise ValueError(f"{', '.join(missing)}: required for clustering_type schedule_based; give the "
                                 "data analyzer's file prefix (or set clustering_type: single_cluster)")
        if self.difficulty_type == "percentile" and not 1 <= self.min_difficulty <= self.max_difficulty <= 100:
            raise ValueError(f"min_difficulty/max_difficulty: percentiles must lie in 1..100, got "
                             f"{self.min_difficulty}..{self.max_difficulty}")
        return self


class DataCurriculumConfig(ConfigSection):
    """`data_sampling.curriculum_learning`: each global batch is drawn from the samples that every
    schedule-based metric allows at the current step (`deepfleet.engine.data_sampling`)."""

    enabled: Bool = False
    """Sample by curriculum (needs `data_efficiency.enabled` and `data_sampling.enabled` too)."""
    data_cluster_path: str | None = None
    """Folder where rank 0 writes each difficulty cluster's shuffled sample indices as an index file."""
    curriculum_metrics: dict[str, CurriculumMetricConfig] = Field(default_factory=dict)
    """The metrics, by name."""

    @model_validator(mode="after")
    def _metrics(self) -> DataCurriculumConfig:
        if self.enabled and not self.curriculum_metrics:
            raise ValueError("curriculum_metrics: enabled needs at least one metric; add one or disable it")
        if self.enabled and self.data_cluster_path is None:
            raise ValueError("data_cluster_path: required when enabled; give a writable folder for the clusters")
        return self


class DataSamplingConfig(ConfigSection):
    """`data_efficiency.data_sampling`."""

    enabled: Bool = False
    """Sampling switch: the curriculum acts only when this and `data_efficiency.enabled` are true."""
    num_epochs: Int = Field(1000, gt=0)
    """Passes over the dataset the sampler may draw (its length: dataset size x num_epochs)."""
    num_workers: Int = Field(0, ge=0)
    """Data-loader worker processes of the curriculum loader."""
    pin_memory: Bool = False
    """Pin the curriculum loader's batches (an accelerator only)."""
    curriculum_learning: DataCurriculumConfig = Field(default_factory=DataCurriculumConfig)
    """The data-analyzer curriculum."""


class DataEfficiencyConfig(ConfigSection):
    """`data_efficiency`: DeepSpeed's data-efficiency library: random-LTD and curriculum data sampling."""

    enabled: Bool = False
    """Master switch: nothing below acts unless this is true."""
    seed: Int = 1234
    """Seed of the token sampling (per rank: seed + rank)."""
    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig)
    """Data routing: random-LTD."""
    data_sampling: DataSamplingConfig = Field(default_factory=DataSamplingConfig)
    """Data sampling: the data-analyzer curriculum."""

    def data_curriculum(self) -> DataCurriculumConfig | None:
        """The data-sampling curriculum when every switch above it is on, else None."""
        sampling = self.data_sampling
        if self.enabled and sampling.enabled and sampling.curriculum_learning.enabled:
            return sampling.curriculum_learning
        return None

    def random_ltd(self) -> RandomLTDConfig | None:
        """The random-LTD section when every switch above it is on, else None."""
        routing = self.data_routing
        if self.enabled and routing.enabled and routing.random_ltd is not None and routing.random_ltd.enabled:
            return routing.random_ltd
        return None
