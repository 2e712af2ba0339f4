"""The `zero_optimization` section of the engine config (ZeRO stage, buckets, offload).

Field names are DeepSpeed's JSON keys (the `stage3_*` knobs keep their prefix; DeepSpeed's short
spellings such as `prefetch_bucket_size` are accepted as aliases) and defaults are the values in
DeepSpeed's `runtime/zero/config.py` and `offload_config.py`. Read by the ZeRO strategies under
`deepfleet.engine.zero` and by the offload code. Torch-free.

Typed per stage: `READ_AT_STAGES` names the knobs that only some stages read (DeepSpeed's own split:
its stage-1/2 optimizer takes `allgather_*`, `reduce_scatter` and `round_robin_gradients`, its
stage-3 optimizer the `stage3_*` knobs and `sub_group_size`; our own
`deepfleet_local_grad_accumulation` is read at stages 2 and 3), and `out_of_stage` reports each one
set at a stage that does not read it. The rule, and why:
- at DeepSpeed's default value (or HF's `"auto"`) such a knob is accepted silently: published
  example configs carry them at every stage (HF's and DeepSpeed's templates, LLaVA's `zero2.json`
  with `sub_group_size: 1e9`) and the value changes nothing under either engine;
- at any other value it is accepted with a `ConfigWarning` naming the key, the stages that read it
  and the fix, rather than refused: DeepSpeed accepts such configs, and widely used generators emit
  them (DeepSpeed-Chat's `get_train_ds_config` writes `stage3_max_live_parameters: 3e7` and friends
  at stage 2), so refusing would break configs that run unchanged on DeepSpeed, while staying silent
  would hide a setting that does nothing. `warnings.simplefilter("error", ConfigWarning)` makes it
  an error for those who want that.
`stage3_gather_16bit_weights_on_model_save` is read at every stage: true asks `save_16bit_model` for
full weights, which stages 0-2 always write (DeepSpeed's meaning too), so it is never out of stage.
"""
from __future__ import annotations

import sys
from typing import Annotated, Literal

from pydantic import AfterValidator, AliasChoices, Field, model_validator

from deepfleet.engine.config_base import Bool, ConfigSection, Float, Int

OffloadDevice = Literal["none", "cpu", "nvme"]


class OffloadParamConfig(ConfigSection):
    """`zero_optimization.offload_param`: keep stage-3 parameter shards off the device between uses."""

    device: OffloadDevice = "none"
    """Where parameter shards live: `none` (accelerator), `cpu` (host memory: a no-op when training
    already runs on the CPU), `nvme` (files under `nvme_path` between optimizer steps,
    engine/zero/nvme_param.py)."""
    pin_memory: Bool = True
    """Page-locked host buffers (faster host<->device copies, uses locked memory); DeepSpeed's default."""
    nvme_path: str | None = None
    """Directory for NVMe offload (device `nvme`): shard files go to `deepfleet-params/<job>-rank<r>/` under it."""
    buffer_count: Int = Field(5, ge=0)
    """FSDP units read ahead at once as forward and backward proceed (device `nvme`); 0 reads each unit
    only when forward or backward reaches it."""
    buffer_size: Int = Field(100_000_000, ge=0)
    """Elements per read-ahead buffer (device `nvme`): past the first unit, the read-ahead holds at most
    `buffer_count * buffer_size` elements in flight."""
    max_in_cpu: Int = Field(1_000_000_000, ge=0)
    """Parameter elements kept in host memory under NVMe offload (device `nvme`): FSDP units, in module
    order, stay resident while their shards fit; the default keeps models up to 1e9 elements whole."""


class OffloadOptimizerConfig(ConfigSection):
    """`zero_optimization.offload_optimizer`: keep optimizer state in host memory and step it on the CPU."""

    device: OffloadDevice = "none"
    """Where optimizer state lives: `none` (accelerator), `cpu` (host memory: a no-op when training
    already runs on the CPU), `nvme` (files under `nvme_path` between steps, engine/zero/nvme.py)."""
    pin_memory: Bool = True
    """Page-locked host buffers (faster host<->device copies, uses locked memory); DeepSpeed's default."""
    nvme_path: str | None = None
    """Directory for NVMe offload (device `nvme`): state files go to `deepfleet-optimizer/<job>-rank<r>/` under it."""
    buffer_count: Int = Field(4, ge=1)
    """Host buffers the NVMe step cycles through (device `nvme`): chunks read ahead or being written
    back each hold one; each buffer holds one chunk of `sub_group_size` elements' state."""
    pipeline_read: Bool = False
    """Read the next chunk on a background thread while the current one steps (device `nvme`)."""
    pipeline_write: Bool = False
    """Write each stepped chunk back on a background thread (device `nvme`)."""
    fast_init: Bool = False
    """DeepSpeed's fast state initialisation under NVMe offload: state is always created chunk by chunk
    by the first step here (never whole in memory), which is that fast path, so either value behaves so."""
    ratio: Float = Field(1.0, ge=0.0, le=1.0)
    """Fraction of the optimizer step run on the CPU (partial offload is not supported yet: only 1.0)."""


class AioConfig(ConfigSection):
    """`aio`: how NVMe offload files are read and written (DeepSpeed's async-I/O keys and defaults)."""

    block_size: Int = Field(1_048_576, gt=0)
    """Bytes per I/O request."""
    queue_depth: Int = Field(8, gt=0)
    """Requests in flight per I/O thread."""
    thread_count: Int = Field(1, gt=0)
    """Threads issuing a chunk's requests."""
    single_submit: Bool = False
    """Issue requests one at a time instead of in batches of `queue_depth`."""
    overlap_events: Bool = True
    """Submit a new request as each one completes (a sliding window of `queue_depth` per thread);
    false submits a batch, waits for all of it, then submits the next."""
    use_gds: Bool = False
    """GPUDirect Storage; only false (no accelerator path here)."""

    @model_validator(mode="after")
    def _check(self) -> AioConfig:
        if self.use_gds:
            raise ValueError("use_gds: GPUDirect Storage is not supported yet; drop it or set it to false")
        return self


class ConfigWarning(UserWarning):
    """A config key that is accepted but changes nothing as configured (one line: key, why, fix)."""


def _stage_in_range(stage: int) -> int:
    if not 0 <= stage <= 3:
        raise ValueError(f"{stage} is out of range; use 0, 1, 2 or 3")
    return stage


# Offload keys that only mean something for NVMe, with DeepSpeed's defaults: set to anything else
# without device nvme they would be silently ignored, so they are reported instead.
_NVME_ONLY = {
    "offload_param": {"nvme_path": None, "buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000},
    "offload_optimizer": {"nvme_path": None, "buffer_count": 4, "pipeline_read": False, "pipeline_write": False,
                          "fast_init": False},
}


class ZeroConfig(ConfigSection):
    """`zero_optimization`: how model states are partitioned across the data-parallel ranks."""

    stage: Annotated[Int, AfterValidator(_stage_in_range)] = 0
    """0 = replicated (DDP); 1 = optimizer state partitioned; 2 = + gradients; 3 = + parameters."""
    contiguous_gradients: Bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation)."""
    reduce_scatter: Bool = True
    """Average gradients with reduce-scatter (stages 1/2) instead of all-reduce."""
    reduce_bucket_size: Int = Field(500_000_000, gt=0)
    """Elements reduced per collective call (bucket size of the gradient reduction)."""
    allgather_partitions: Bool = True
    """Gather updated partitions with all-gather (true) or per-rank broadcasts (false)."""
    allgather_bucket_size: Int = Field(500_000_000, gt=0)
    """Elements gathered per collective call after the optimizer step (stages 1/2)."""
    overlap_comm: Bool | None = None
    """Overlap gradient reduction with the backward pass; unset = true at stage 3, false otherwise."""
    deepfleet_local_grad_accumulation: Bool = False
    """deepfleet's own key (not DeepSpeed's). Stages 2 and 3 with gradient accumulation: false
    (DeepSpeed's semantics) reduce-scatters gradients into the partitioned shards on every micro-step,
    so full gradients never outlive their bucket (stage 2) or FSDP unit (stage 3); true accumulates full
    gradients locally and communicates only on the boundary micro-step (1/gradient_accumulation_steps
    of the gradient traffic, but 4 bytes per parameter of full fp32 gradients held through the window).
    Read at stages 2 and 3 (stages 0 and 1 always accumulate locally)."""
    round_robin_gradients: Bool = False
    """Stages 1/2 with CPU offload: spread gradient copies to host over ranks in round-robin order."""
    sub_group_size: Int = Field(1_000_000_000, ge=0)
    """Elements per optimizer-step tile at stage 3 (bounds the step's temporary memory); with
    `offload_optimizer.device: nvme`, at every stage, the parameter elements per chunk read from and
    written to the offload files (the buffers hold one chunk's state each)."""
    offload_param: OffloadParamConfig | None = None
    """Parameter offload (stage 3 only)."""
    offload_optimizer: OffloadOptimizerConfig | None = None
    """Optimizer-state offload (stages 1, 2, 3)."""
    stage3_prefetch_bucket_size: Int = Field(
        50_000_000, ge=0, validation_alias=AliasChoices("stage3_prefetch_bucket_size", "prefetch_bucket_size")
    )
    """Stage 3: parameter elements fetched ahead of use (0 = no prefetch)."""
    stage3_param_persistence_threshold: Int = Field(
        100_000,
        ge=0,
        validation_alias=AliasChoices("stage3_param_persistence_threshold", "param_persistence_threshold"),
    )
    """Stage 3: parameters with fewer elements stay unpartitioned."""
    stage3_model_persistence_threshold: Int = Field(
        sys.maxsize,
        ge=0,
        validation_alias=AliasChoices("stage3_model_persistence_threshold", "model_persistence_threshold"),
    )
    """Stage 3: upper bound on the total elements kept unpartitioned by the persistence threshold."""
    stage3_max_live_parameters: Int = Field(
        1_000_000_000, ge=0, validation_alias=AliasChoices("stage3_max_live_parameters", "max_live_parameters")
    )
    """Stage 3: parameter elements kept gathered at once before releasing."""
    stage3_max_reuse_distance: Int = Field(
        1_000_000_000, ge=0, validation_alias=AliasChoices("stage3_max_reuse_distance", "max_reuse_distance")
    )
    """Stage 3: do not release a parameter reused within this many elements of fetches."""
    stage3_gather_16bit_weights_on_model_save: Bool = Field(
        False,
        validation_alias=AliasChoices(
            "stage3_gather_16bit_weights_on_model_save",
            "gather_16bit_weights_on_model_save",
            "stage3_gather_fp16_weights_on_model_save",  # DeepSpeed's deprecated spelling
        ),
    )
    """Stage 3: gather full 16-bit weights when saving a model file."""

    @model_validator(mode="after")
    def _check(self) -> ZeroConfig:
        problems: list[str] = []
        if self.overlap_comm is None:
            self.overlap_comm = self.stage == 3
        param_offload = self.offload_param is not None and self.offload_param.device != "none"
        if param_offload and self.stage != 3:
            problems.append(
                f"offload_param: parameter offload needs stage 3 (stage is {self.stage}); "
                "set zero_optimization.stage to 3 or drop offload_param"
            )
        optim_offload = self.offload_optimizer is not None and self.offload_optimizer.device != "none"
        if optim_offload and self.stage == 0:
            problems.append(
                "offload_optimizer: optimizer offload needs stage 1, 2 or 3 (stage is 0); "
                "set zero_optimization.stage or drop offload_optimizer"
            )
        for name, section in (("offload_param", self.offload_param), ("offload_optimizer", self.offload_optimizer)):
            if section is None:
                continue
            if section.device == "nvme":
                continue
            for key, default in _NVME_ONLY[name].items():
                if key in section.model_fields_set and getattr(section, key) != default:
                    problems.append(f"{name}.{key}: only read with device \"nvme\"; drop it or set device to \"nvme\"")
        if self.offload_optimizer is not None and self.offload_optimizer.ratio != 1.0:
            problems.append("offload_optimizer.ratio: partial offload is not supported yet; drop it or use 1.0")
        if problems:
            raise ValueError("\n".join(problems))
        return self


# Knobs that only some stages read (see the module docstring); every other key is read at every stage.
READ_AT_STAGES: dict[str, frozenset[int]] = {
    "allgather_partitions": frozenset({1, 2}),
    "allgather_bucket_size": frozenset({1, 2}),
    "reduce_scatter": frozenset({1, 2}),
    "round_robin_gradients": frozenset({1, 2}),
    "deepfleet_local_grad_accumulation": frozenset({2, 3}),
    "sub_group_size": frozenset({3}),
    "stage3_prefetch_bucket_size": frozenset({3}),
    "stage3_param_persistence_threshold": frozenset({3}),
    "stage3_model_persistence_threshold": frozenset({3}),
    "stage3_max_live_parameters": frozenset({3}),
    "stage3_max_reuse_distance": frozenset({3}),
}


def _stages(stages: frozenset[int]) -> str:
    names = [str(s) for s in sorted(stages)]
    return f"stage {names[0]} reads" if len(names) == 1 else f"stages {', '.join(names[:-1])} and {names[-1]} read"


def _nvme_optimizer(zero: ZeroConfig) -> bool:
    return zero.offload_optimizer is not None and zero.offload_optimizer.device == "nvme"


def out_of_stage(zero: ZeroConfig) -> list[str]:
    """One line per knob set to a non-default value at a stage that does not read it."""
    lines = []
    for key, stages in READ_AT_STAGES.items():
        if zero.stage in stages or key not in zero.model_fields_set:
            continue
        if key == "sub_group_size" and _nvme_optimizer(zero):
            continue  # the chunk of the NVMe optimizer step at every stage
        value, default = getattr(zero, key), ZeroConfig.model_fields[key].default
        if value == default:
            continue
        fix = "set zero_optimization.stage to " + " or ".join(str(s) for s in sorted(stages))
        lines.append(
            f"zero_optimization.{key}: only {_stages(stages)} it (stage is {zero.stage}), so {value!r} "
            f"changes nothing; drop it or {fix}"
        )
    return lines


def is_out_of_stage(key: str, stage: object) -> bool:
    """Whether `zero_optimization.<key>` (a field name or alias) is not read at `stage` (raw value)."""
    if not isinstance(stage, int) or isinstance(stage, bool):
        return False
    field = ZeroConfig.model_fields.get(key)
    name = key
    if field is None:
        for candidate, info in ZeroConfig.model_fields.items():
            alias = info.validation_alias
            if isinstance(alias, AliasChoices) and key in alias.choices:
                name = candidate
                break
    stages = READ_AT_STAGES.get(name)
    return stages is not None and stage not in stages
