"""The `data_efficiency` section with DeepSpeed's keys and defaults: `data_routing.random_ltd` (random
layerwise token dropping, `deepfleet.engine.data_routing`). Its other half, `data_sampling` (curriculum
sampling from an offline data-analyzer index), and random-LTD's `layer_token_lr_schedule` (refused by
DeepSpeed itself) are accepted only disabled (`config_keys.NOT_SUPPORTED`). Torch-free."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from deepfleet.engine.config_base import Bool, ConfigSection, Int


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


class DataEfficiencyConfig(ConfigSection):
    """`data_efficiency`: DeepSpeed's data-efficiency library (here: random-LTD)."""

    enabled: Bool = False
    """Master switch: nothing below acts unless this is true."""
    seed: Int = 1234
    """Seed of the token sampling (per rank: seed + rank)."""
    data_routing: DataRoutingConfig = Field(default_factory=DataRoutingConfig)
    """Data routing: random-LTD."""

    def random_ltd(self) -> RandomLTDConfig | None:
        """The random-LTD section when every switch above it is on, else None."""
        routing = self.data_routing
        if self.enabled and routing.enabled and routing.random_ltd is not None and routing.random_ltd.enabled:
            return routing.random_ltd
        return None
