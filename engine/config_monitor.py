"""Config sections of observability: `flops_profiler`, `comms_logger` and the monitors (`tensorboard`,
`wandb`, `csv_monitor`, `comet`, and `mlflow`, which DeepSpeed lacks).

Read by `deepfleet.engine.config.DeepFleetConfig` (the fields) and used by `engine/profiling/`
(profiler, comms logger) and `engine/monitor/` (the sinks), composed in `engine/build.py`. Key names,
meanings and defaults are DeepSpeed's; where DeepSpeed leaves a path empty, the monitor writes under
the working directory. Torch-free.
"""

from __future__ import annotations

from pydantic import Field

from deepfleet.engine.config_base import Bool, ConfigSection, Float, Int

DEFAULT_JOB_NAME = "DeepSpeedJobName"  # DeepSpeed's default, so ported configs write to the same folder


class FlopsProfilerConfig(ConfigSection):
    """`flops_profiler`: profile one training step and print FLOPs, MACs, params and latency per module."""

    enabled: Bool = False
    """Profile the step `profile_step` and report MFU/HFU on every later step."""
    recompute_fwd_factor: Float = Field(0.0, ge=0.0, le=1.0)
    """Fraction of the forward recomputed in backward by activation checkpointing: counted in hardware
    FLOPs (HFU), subtracted from model FLOPs (MFU)."""
    profile_step: Int = Field(1, ge=1)
    """The optimizer step that is profiled (its FLOPs scale every later step's)."""
    module_depth: Int = Field(-1, ge=-1)
    """Deepest module level in the report; -1 = all levels."""
    top_modules: Int = Field(1, ge=1)
    """Modules listed per depth in the aggregated part of the report."""
    detailed: Bool = True
    """Print the per-module tree besides the summary."""
    output_file: str | None = None
    """Append the report to this file instead of printing it."""


class CommsLoggerConfig(ConfigSection):
    """`comms_logger`: per collective count, bytes, latency and bandwidth, summarized every
    `steps_per_print` steps and at the end of training."""

    enabled: Bool = False
    """Summarize the counted collectives."""
    verbose: Bool = False
    """Also log each step's per-op deltas (every step, rank 0)."""
    prof_all: Bool = True
    """Report every op; false: only those in `prof_ops`."""
    prof_ops: list[str] = Field(default_factory=list)
    """Op names to report when `prof_all` is false (e.g. ["all_reduce", "all_gather_into_tensor"])."""
    debug: Bool = False
    """Also log the per-op totals of every rank, not only rank 0."""


class TensorBoardConfig(ConfigSection):
    """`tensorboard`: scalar events (loss, lr, loss scale, throughput) per step, rank 0."""

    enabled: Bool = False
    """Write TensorBoard event files."""
    output_path: str = ""
    """Folder of the run folders; empty = the working directory."""
    job_name: str = DEFAULT_JOB_NAME
    """Run folder under output_path."""


class CSVMonitorConfig(ConfigSection):
    """`csv_monitor`: one CSV file per metric, rows "step,value", rank 0."""

    enabled: Bool = False
    """Write CSV files."""
    output_path: str = ""
    """Folder of the job folders; empty = the working directory."""
    job_name: str = DEFAULT_JOB_NAME
    """Job folder under output_path."""


class WandbConfig(ConfigSection):
    """`wandb`: a Weights & Biases run, rank 0; offline (files only) unless WANDB_MODE says otherwise."""

    enabled: Bool = False
    """Log to a W&B run."""
    group: str | None = None
    """W&B run group."""
    team: str | None = None
    """W&B entity (team or user)."""
    project: str = "deepspeed"
    """W&B project."""


class CometConfig(ConfigSection):
    """`comet`: a Comet ML experiment, rank 0 (needs the comet_ml package)."""

    enabled: Bool = False
    """Log to a Comet experiment."""
    samples_log_interval: Int = Field(100, gt=0)
    """Log every this many samples."""
    project: str | None = None
    """Comet project."""
    workspace: str | None = None
    """Comet workspace."""
    api_key: str | None = None
    """Comet API key (default: comet_ml's own configuration)."""
    experiment_name: str | None = None
    """Experiment name."""
    experiment_key: str | None = None
    """Key of an existing experiment to continue."""
    online: Bool | None = None
    """False: an offline experiment (files only)."""
    mode: str | None = None
    """comet_ml's start mode ("get", "create", "get_or_create")."""


class MLflowConfig(ConfigSection):
    """`mlflow`: an MLflow run, rank 0; a local file store unless `tracking_uri` names a server."""

    enabled: Bool = False
    """Log metrics to an MLflow run."""
    tracking_uri: str | None = None
    """MLflow tracking URI; unset = a file store in ./mlruns (MLFLOW_TRACKING_URI wins when set)."""
    experiment_name: str = "deepfleet"
    """Experiment the run belongs to (created when missing)."""
    run_name: str | None = None
    """Run name; unset = MLflow's generated name."""
