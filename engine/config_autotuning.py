"""The `autotuning` section of the engine config: DeepSpeed's keys, meanings and defaults, read by
`deepfleet tune` (`engine/planner/tune.py`). Torch-free.

`deepfleet tune` searches ZeRO stage x offload x micro-batch size (and activation checkpointing once
the config can express it) for the most tokens/s within a per-rank memory budget: the planner prunes
what cannot fit, short measured trials rank the rest. A training run with the section enabled trains
as usual (the section configures the tuner, not the run).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from deepfleet.engine.config_base import Bool, ConfigSection, Float, Int


class AutotuningConfig(ConfigSection):
    """`autotuning`: what `deepfleet tune` searches and how it measures."""

    enabled: Bool = False
    """The tuner is on for this config: `deepfleet tune` refuses a config whose section sets it false
    (a config without the section tunes with the defaults). A training run trains as usual either way."""
    fast: Bool = True
    """true: tune the micro-batch size per ZeRO stage (offload and checkpointing only where nothing fits
    without them); false: the whole stage x offload x checkpointing x micro-batch grid."""
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    """What a trial maximises: tokens/s, the inverse of the step time, or model FLOP/s (6 x params x tokens/s)."""
    start_profile_step: Int = Field(3, ge=1)
    """First optimizer step a trial times (steps before it warm up)."""
    end_profile_step: Int = Field(5, ge=1)
    """Last optimizer step a trial runs and times."""
    metric_path: str | None = None
    """Where a trial writes its metric JSON (default: its experiment folder under exps_dir)."""
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    """Order of the trials: the grid in order, shuffled, or best planner-predicted throughput first."""
    tuner_early_stopping: Int = Field(5, ge=1)
    """Stop after this many trials in a row that do not beat the best."""
    tuner_num_trials: Int = Field(50, ge=1)
    """At most this many measured trials."""
    max_train_batch_size: Int | None = Field(None, gt=0)
    """Largest train_batch_size (micro x accumulation x data-parallel size) a candidate may have."""
    min_train_batch_size: Int = Field(1, gt=0)
    """Smallest train_batch_size a candidate may have."""
    max_train_micro_batch_size_per_gpu: Int = Field(1024, gt=0)
    """Largest micro-batch size tried."""
    min_train_micro_batch_size_per_gpu: Int = Field(1, gt=0)
    """Smallest micro-batch size tried."""
    num_tuning_micro_batch_sizes: Int = Field(3, ge=1)
    """Micro-batch sizes tried per stage, spread from the smallest to the largest that fits."""
    mp_size: Int = Field(1, ge=1)
    """Model-parallel degree of the job: data-parallel size = world size / mp_size."""
    results_dir: str = "autotuning_results"
    """Where the winning config (ds_config_optimal.json) and the trial summary are written."""
    exps_dir: str = "autotuning_exps"
    """Where each experiment's config and measured metric are written."""
    overwrite: Bool = True
    """Run experiments again even when exps_dir holds their results (false: reuse them)."""
    deepfleet_budget_gib: Float | None = Field(None, gt=0)
    """deepfleet's own key (not DeepSpeed's): the per-rank memory budget in GiB when a job's managed
    training loop tunes itself before training (`deepfleet tune` takes `--budget-gib`); unset = no
    budget (the planner prunes nothing)."""

    @model_validator(mode="after")
    def _steps_in_order(self) -> AutotuningConfig:
        if self.end_profile_step < self.start_profile_step:
            raise ValueError(f"end_profile_step ({self.end_profile_step}) is before start_profile_step "
                             f"({self.start_profile_step}); set end_profile_step >= start_profile_step")
        if self.max_train_micro_batch_size_per_gpu < self.min_train_micro_batch_size_per_gpu:
            raise ValueError("max_train_micro_batch_size_per_gpu is below min_train_micro_batch_size_per_gpu; "
                             "raise the maximum or lower the minimum")
        return self
