"""The engine config: DeepSpeed's JSON/YAML config, parsed, checked and normalized.

Called by `deepfleet.engine.initialize` (engine side) and by `deepfleet validate` and the
controller's job validation (both torch-free: this module and its `config_*` siblings never import
torch). `load_config` accepts a dict, a path to a .json/.yaml/.yml file, or a JSON string, and
returns a `DeepFleetConfig` whose attribute names are DeepSpeed's keys and whose defaults are
DeepSpeed's code defaults, with every derived value resolved (batch triple, `overlap_comm`,
Adam's weight decay, HF-style `"auto"` where it is well defined). Every problem is collected and
raised at once as `ConfigError`, one line each: `"<dotted.key>: <problem>; <fix>"`.

Order of `load_config`: read the source -> legacy forms -> canonicalize optimizer/scheduler
types -> drop unknown and not-yet-supported keys (named) -> resolve `"auto"` -> pydantic
validation (types, ranges, cross-field checks) -> translate pydantic's errors to dotted lines.

Siblings: `config_base` (ConfigError, strict number/bool types), `config_source` (reading files
and strings), `config_keys` (unknown and not-yet-supported keys), `config_optim` (optimizer and
scheduler sections), `config_zero` (zero_optimization, typed per stage, and `ConfigWarning`),
`config_noops` (accepted keys that change nothing, with the reason; mirrored in docs/engine.md).

Layout decision: the sections stay flat `engine/config*.py` modules rather than a `config/`
package or files beside each section's owner. Many modules across engine, worker and controller
import these paths, and the import contracts name them (`engine.config*` is what the controller
may use and what must stay torch-free); moving them would churn every importer for no behaviour
change. A new section is a new `config_<name>.py` here (`config_compression` holds
`compression_training`); the import contracts cover it without edits.
"""

from __future__ import annotations

import copy
import difflib
import math
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, Field, ValidationError, ValidationInfo, model_validator

from deepfleet.engine.config_activation_checkpointing import (
    ActivationCheckpointingConfig,
    BlockCheckpointingConfig,
)
from deepfleet.engine.config_autotuning import AutotuningConfig
from deepfleet.engine.config_base import Bool, ConfigError, ConfigSection, Float, Int
from deepfleet.engine.config_batch_elasticity import apply_elasticity
from deepfleet.engine.config_checkpoint import CheckpointConfig, CompileConfig, TimersConfig
from deepfleet.engine.config_communication import CommunicationConfig
from deepfleet.engine.config_compression import CompressionConfig
from deepfleet.engine.config_curriculum import (
    CurriculumLearningConfig,
    EigenvalueConfig,
    ProgressiveLayerDropConfig,
)
from deepfleet.engine.config_data_efficiency import DataEfficiencyConfig
from deepfleet.engine.config_elasticity import ElasticityConfig
from deepfleet.engine.config_keys import check_keys
from deepfleet.engine.config_moe import MoEConfig
from deepfleet.engine.config_monitor import (
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    FlopsProfilerConfig,
    MLflowConfig,
    TensorBoardConfig,
    WandbConfig,
)
from deepfleet.engine.config_onebit import one_bit_stage_problem
from deepfleet.engine.config_optim import (
    OPTIMIZER_TYPES,
    OPTIMIZERS_NOT_SUPPORTED,
    SCHEDULER_TYPES,
    OptimizerConfig,
    SchedulerConfig,
)
from deepfleet.engine.config_pipeline import PipelineConfig
from deepfleet.engine.config_privacy import DifferentialPrivacyConfig
from deepfleet.engine.config_source import read_source
from deepfleet.engine.config_sparse_attention import SparseAttentionConfig
from deepfleet.engine.config_tensor_parallel import TensorParallelConfig
from deepfleet.engine.config_zero import AioConfig, ConfigWarning, ZeroConfig, is_out_of_stage, out_of_stage

__all__ = ["ConfigError", "ConfigWarning", "DeepFleetConfig", "FP16Config", "BF16Config", "load_config"]

AUTO = "auto"
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class FP16Config(ConfigSection):
    """`fp16`: float16 mixed precision with loss scaling."""

    enabled: Bool = False
    """Train with float16 weights/activations and fp32 master weights."""
    auto_cast: Bool = False
    """Cast the model's floating-point inputs to float16 before forward."""
    loss_scale: Float = Field(0.0, ge=0.0)
    """Static loss scale; 0 selects dynamic loss scaling."""
    initial_scale_power: Int = Field(16, ge=0)
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: Int = Field(1000, gt=0)
    """Steps without overflow before the dynamic scale is doubled."""
    hysteresis: Int = Field(2, ge=1)
    """Overflows tolerated before the dynamic scale is halved."""
    consecutive_hysteresis: Bool = False
    """Refill the hysteresis budget after every step without overflow."""
    min_loss_scale: Float = Field(1.0, gt=0.0)
    """Lower bound of the dynamic loss scale."""


class BF16Config(ConfigSection):
    """`bf16` (DeepSpeed also reads the old spelling `bfloat16`): bfloat16 mixed precision."""

    enabled: Bool = False
    """Train with bfloat16 weights/activations and fp32 master weights (no loss scaling needed)."""


class DeepFleetConfig(ConfigSection):
    """The whole engine config. Attribute names are DeepSpeed's keys; everything is resolved after load."""

    train_batch_size: Int | None = Field(None, gt=0)
    """Samples per optimizer step over all ranks = micro batch * accumulation steps * world size."""
    train_micro_batch_size_per_gpu: Int | None = Field(None, gt=0)
    """Samples per forward/backward on one rank."""
    gradient_accumulation_steps: Int | None = Field(None, gt=0)
    """Micro-batches accumulated before each optimizer step."""
    optimizer: OptimizerConfig | None = None
    """Optimizer built by the engine; unset when the caller passes its own optimizer."""
    scheduler: SchedulerConfig | None = None
    """LR schedule built by the engine, stepped once per optimizer step."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    """float16 mixed precision."""
    bf16: BF16Config = Field(default_factory=BF16Config, validation_alias=AliasChoices("bf16", "bfloat16"))
    """bfloat16 mixed precision."""
    gradient_clipping: Float = Field(0.0, ge=0.0)
    """Clip the global gradient L2 norm to this value; 0 disables clipping (the norm is still computed)."""
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO partitioning of model states."""
    aio: AioConfig = Field(default_factory=AioConfig)
    """File I/O of NVMe offload (`zero_optimization.offload_optimizer.device: nvme`)."""
    steps_per_print: Int | None = Field(None, gt=0)
    """Log progress every this many optimizer steps; unset = never."""
    wall_clock_breakdown: Bool = False
    """Time forward, backward and step separately and log the breakdown."""
    seed: Int = Field(0, ge=0)
    """Seed of the data sampler's shuffling (0 = torch DistributedSampler's default, as DeepSpeed gets)."""
    prescale_gradients: Bool = False
    """Divide gradients by the world size before the reduction instead of after."""
    gradient_predivide_factor: Float = Field(1.0, gt=0.0)
    """Divide gradients by this before the reduction and by world_size / factor after."""
    zero_allow_untested_optimizer: Bool = False
    """Allow a caller-supplied optimizer that is not one of the built-in types with ZeRO stages >= 1."""
    dump_state: Bool = False
    """Print the resolved config at initialization."""
    compression_training: CompressionConfig | None = None
    """DeepSpeed Compression: quantization-aware training, pruning, layer reduction (engine/compression/)."""
    communication: CommunicationConfig = Field(default_factory=CommunicationConfig)
    """deepfleet's own: compression of the gradient reduction and its guard (engine/gradcomp/)."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Pipeline parallelism of a PipelineModule (engine/pipe/): stages, schedule, activation checkpointing."""
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """Profile one step's FLOPs per module; MFU/HFU per step after it (engine/profiling/)."""
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """Per-collective counts, bytes, latency and bandwidth summaries (engine/profiling/comms_logger.py)."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor (engine/monitor/)."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases monitor (engine/monitor/)."""
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    """CSV monitor (engine/monitor/)."""
    comet: CometConfig = Field(default_factory=CometConfig)
    """Comet ML monitor (engine/monitor/)."""
    mlflow: MLflowConfig = Field(default_factory=MLflowConfig)
    """MLflow monitor (engine/monitor/)."""
    progressive_layer_drop: ProgressiveLayerDropConfig = Field(default_factory=ProgressiveLayerDropConfig)
    """Progressive layer drop: the keep-probability schedule passed to the model (engine/curriculum.py)."""
    curriculum_learning: CurriculumLearningConfig = Field(default_factory=CurriculumLearningConfig)
    """DeepSpeed's legacy sequence-length curriculum passed to the model (engine/curriculum.py)."""
    data_efficiency: DataEfficiencyConfig = Field(default_factory=DataEfficiencyConfig)
    """DeepSpeed's data efficiency: random layerwise token dropping (engine/data_routing.py) and curriculum
    data sampling (engine/data_sampling.py)."""
    eigenvalue: EigenvalueConfig = Field(default_factory=EigenvalueConfig)
    """Block Hessian eigenvalues by power iteration at accumulation boundaries (engine/eigenvalue.py)."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint tag validation and DeepSpeed's storage switches (engine/config_checkpoint.py)."""
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig)
    """DeepSpeed Elasticity: the batch chosen to suit many data-parallel sizes (engine/elasticity.py)."""
    timers: TimersConfig = Field(default_factory=TimersConfig)
    """The throughput timer of `engine.tput_timer` (engine/config_checkpoint.py)."""
    compile: CompileConfig = Field(default_factory=CompileConfig)
    """`torch.compile` of the wrapped model (engine/config_checkpoint.py)."""
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    """What `deepfleet tune` searches and how it measures (engine/config_autotuning.py, engine/planner/tune.py)."""
    sparse_attention: SparseAttentionConfig | None = None
    """Block-sparse attention layout for the model to build (engine/attention/); unset = dense attention."""
    sequence_parallel_size: Int = Field(1, gt=0)
    """Ulysses sequence parallelism: ranks that split each sequence (the mesh's `sp` axis, engine/attention/)."""
    seq_parallel_communication_data_type: Literal["fp16", "bf16", "fp32"] = "fp32"
    """dtype of the sequence-parallel all-to-alls (DeepSpeed's key)."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """AutoTP training: tensor parallelism of the blocks' Linear layers (the mesh's `tp` axis, engine/autotp.py)."""
    moe: MoEConfig | None = None
    """Mixture-of-Experts shape and expert-parallel degree (deepfleet's own section; engine/moe/)."""
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    """DeepSpeed's options of the `deepspeed.checkpointing` API (engine/compat/checkpointing.py)."""
    deepfleet_activation_checkpointing: BlockCheckpointingConfig = Field(default_factory=BlockCheckpointingConfig)
    """deepfleet's own: checkpoint the model's blocks from the config (engine/activation_checkpointing.py)."""
    deepfleet_differential_privacy: DifferentialPrivacyConfig = Field(default_factory=DifferentialPrivacyConfig)
    """DP-SGD: per-sample clipping, Gaussian noise and an (epsilon, delta) accountant (deepfleet's own
    section; engine/privacy.py)."""

    @model_validator(mode="after")
    def _resolve_and_check(self, info: ValidationInfo) -> DeepFleetConfig:
        context = info.context or {}
        problems = _resolve_batch(
            self, world_size=context.get("world_size", 1), auto=context.get("auto", set()),
            label=context.get("label", "world size"),
        )
        problems += _precision_conflicts(fp16=self.fp16.enabled, bf16=self.bf16.enabled)
        problems += one_bit_stage_problem(self.optimizer, self.zero_optimization.stage)
        if self.eigenvalue.enabled and self.zero_optimization.stage == 3:
            problems.append("eigenvalue.enabled: block eigenvalues need twice-differentiable parameters, which "
                            "ZeRO stage 3's gathers are not; use zero_optimization.stage 0, 1 or 2, or disable it")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def to_dict(self) -> dict[str, Any]:
        """The normalized config as plain JSON-compatible data (every default filled in)."""
        return self.model_dump(mode="json")

    # DeepSpeed's `engine.config` is the config dict; integrations read it so
    # (`engine.config.get("zero_optimization", {}).get("stage")` in HF's Trainer). Read-only views of
    # `to_dict()`; the typed attributes stay the engine's own interface.
    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __contains__(self, key: object) -> bool:
        return key in self.to_dict()


def _precision_conflicts(*, fp16: Any, bf16: Any) -> list[str]:
    if fp16 is True and bf16 is True:
        return ["fp16.enabled: fp16 and bf16 are both enabled; enable only one of them"]
    return []


def _resolve_batch(cfg: Any, *, world_size: int, auto: set[str], label: str = "world size") -> list[str]:
    """Fill in the batch triple (train_batch_size = micro * gas * data-parallel size) or explain why not.
    `world_size` is that data-parallel size; `label` is how messages name it.

    `cfg` is the validated model or, before validation, a `_RawBatch` view of the raw dict, so that
    batch errors are reported even when other keys fail validation.
    """
    tbs, micro, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    ws = world_size
    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * ws:
            return [
                f"train_batch_size: {tbs} != {micro} (micro) * {gas} (gas) * {ws} ({label}) = {micro * gas * ws}; "
                "fix one of the three or drop train_batch_size"
            ]
    elif tbs is not None and micro is not None:
        if tbs % (micro * ws):
            return [
                f"train_batch_size: {tbs} is not divisible by {micro} (micro) * {ws} ({label}) = {micro * ws}; "
                f"use a multiple of {micro * ws} or set gradient_accumulation_steps"
            ]
        gas = tbs // (micro * ws)
    elif tbs is not None and gas is not None:
        if tbs % (gas * ws):
            return [
                f"train_batch_size: {tbs} is not divisible by {gas} (gas) * {ws} ({label}) = {gas * ws}; "
                f"use a multiple of {gas * ws} or set train_micro_batch_size_per_gpu"
            ]
        micro = tbs // (gas * ws)
    elif micro is not None:
        gas = 1 if gas is None else gas
        tbs = micro * gas * ws
    elif tbs is not None:
        gas = 1
        if tbs % ws:
            return [
                f"train_batch_size: {tbs} is not divisible by the {label} {ws}; "
                f"use a multiple of {ws} or set train_micro_batch_size_per_gpu"
            ]
        micro = tbs // ws
    else:
        unresolved = [k for k in BATCH_KEYS if k in auto]
        if unresolved:
            return [
                f"{key}: 'auto' cannot be resolved by the engine (it needs train_batch_size or "
                "train_micro_batch_size_per_gpu as a number); set a number"
                for key in unresolved
            ]
        return [
            "train_micro_batch_size_per_gpu: missing; set train_micro_batch_size_per_gpu "
            "(and optionally gradient_accumulation_steps) or train_batch_size"
        ]
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = tbs, micro, gas
    return []


class _RawBatch:
    """The batch triple of a raw dict, if all present values are positive integers (else `usable` is False)."""

    def __init__(self, data: dict) -> None:
        self.usable = True
        for key in BATCH_KEYS:
            value = data.get(key)
            usable = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if value is not None and not (usable and value > 0 and value == int(value)):
                self.usable = False  # pydantic reports the value itself
                value = None
            setattr(self, key, None if value is None else int(value))


def _raw_checks(data: dict, *, world_size: int, auto_batch: set[str], errors: list[str], label: str) -> None:
    """Cross-key checks on the raw dict, so they are reported even when unrelated keys fail validation."""
    batch = _RawBatch(data)
    if batch.usable:
        errors.extend(_resolve_batch(batch, world_size=world_size, auto=auto_batch, label=label))
    fp16, bf16 = data.get("fp16"), data.get("bf16", data.get("bfloat16"))
    if isinstance(fp16, dict) and isinstance(bf16, dict):
        errors.extend(_precision_conflicts(fp16=fp16.get("enabled"), bf16=bf16.get("enabled")))


# --------------------------------------------------------------------------- raw-dict passes


def _legacy_forms(data: dict, errors: list[str]) -> None:
    """Rewrite DeepSpeed's older spellings into the current keys, as DeepSpeed reads them:
    `zero_optimization: true|false` (stage 1 | 0), `zero_optimization.cpu_offload`/`cpu_offload_param`/
    `cpu_offload_use_pin_memory` (the `offload_*` sections) and `optimizer.params.max_grad_norm` (the
    top-level `gradient_clipping`). A legacy key that contradicts its current form is an error."""
    if data.get("steps_per_print") == float("inf"):  # what Accelerate writes for "never" (DeepSpeed accepts it)
        data["steps_per_print"] = None
    zero = data.get("zero_optimization")
    if isinstance(zero, bool):
        data["zero_optimization"] = zero = {"stage": 1 if zero else 0}
    if isinstance(zero, dict):
        pin = zero.pop("cpu_offload_use_pin_memory", None)
        for legacy, section in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            if legacy not in zero:
                continue
            value = zero.pop(legacy)
            if not isinstance(value, bool):
                errors.append(f"zero_optimization.{legacy}: must be true or false, got {value!r}")
                continue
            current = zero.get(section)
            device = current.get("device", "none") if isinstance(current, dict) else None
            if value and device not in (None, "cpu"):
                errors.append(f"zero_optimization.{legacy}: true contradicts {section}.device={device!r}; "
                              f"drop {legacy} (the older spelling)")
            elif value and current is None:
                zero[section] = {"device": "cpu"}
        if isinstance(pin, bool):
            for section in ("offload_optimizer", "offload_param"):
                if isinstance(zero.get(section), dict):
                    zero[section].setdefault("pin_memory", pin)
        elif pin is not None:
            errors.append(f"zero_optimization.cpu_offload_use_pin_memory: must be true or false, got {pin!r}")
    params = data.get("optimizer", {}).get("params") if isinstance(data.get("optimizer"), dict) else None
    if isinstance(params, dict) and "max_grad_norm" in params:
        norm = params.pop("max_grad_norm")
        clip = data.get("gradient_clipping")
        if isinstance(norm, bool) or not isinstance(norm, (int, float)) or norm < 0:
            errors.append(f"optimizer.params.max_grad_norm: must be a number >= 0, got {norm!r}")
        elif norm and clip not in (None, 0, 0.0, norm):
            errors.append(f"optimizer.params.max_grad_norm: {norm} contradicts gradient_clipping: {clip}; "
                          "keep only gradient_clipping")
        elif norm:
            data["gradient_clipping"] = norm


def _drop_auto_out_of_stage(data: dict) -> None:
    """HF's "auto" for a knob the configured ZeRO stage does not read means "the default": drop it, so it
    neither needs the hidden size nor resolves to a value that would be reported as out of stage."""
    zero = data.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    for key in [k for k, v in zero.items() if v == AUTO and is_out_of_stage(k, zero.get("stage", 0))]:
        del zero[key]


def _canonical_type(data: dict, section: str, known: tuple[str, ...], unsupported: tuple[str, ...],
                    errors: list[str]) -> None:
    """Match `<section>.type` case-insensitively; drop the section when the type is unusable."""
    value = data.get(section)
    if value is None or not isinstance(value, dict):
        return
    kind = value.get("type")
    if not isinstance(kind, str):
        errors.append(f"{section}.type: missing or not a string; set one of {', '.join(known)}")
        del data[section]
        return
    by_lower = {name.lower(): name for name in known}
    if kind.lower() in by_lower:
        value["type"] = by_lower[kind.lower()]
        return
    del data[section]
    if kind.lower() in {name.lower() for name in unsupported}:
        errors.append(f"{section}.type: {kind!r} is not supported yet; use one of {', '.join(known)}")
        return
    close = difflib.get_close_matches(kind.lower(), list(by_lower), n=1, cutoff=0.6)
    hint = f"did you mean {by_lower[close[0]]!r}? " if close else ""
    errors.append(f"{section}.type: unknown {section} {kind!r}; {hint}use one of {', '.join(known)}")


def _hf_bucket_sizes(hidden_size: int) -> dict[str, int]:
    # The formulas the HF Trainer uses to fill these "auto" values from the model's hidden size.
    return {
        "zero_optimization.reduce_bucket_size": hidden_size * hidden_size,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "zero_optimization.prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden_size,
        "zero_optimization.param_persistence_threshold": 10 * hidden_size,
    }


_NEEDS_HIDDEN_SIZE = frozenset(_hf_bucket_sizes(1))


def _resolve_auto(data: dict, *, path: str, fill: Mapping[str, Any], auto_batch: set[str],
                  errors: list[str]) -> None:
    """Replace "auto" values found in `fill` (dotted key -> value), drop the batch triple's (derived
    later), report the rest."""
    for key in list(data):
        value = data[key]
        dotted = f"{path}{key}"
        if isinstance(value, dict):
            _resolve_auto(value, path=dotted + ".", fill=fill, auto_batch=auto_batch, errors=errors)
            continue
        if not (isinstance(value, str) and value == AUTO):
            continue
        if dotted in fill:
            data[key] = copy.deepcopy(fill[dotted])
        elif dotted in BATCH_KEYS:
            auto_batch.add(dotted)
            del data[key]
        elif dotted in _NEEDS_HIDDEN_SIZE:
            errors.append(
                f"{dotted}: 'auto' needs the model's hidden size; pass hidden_size to load_config "
                "(deepfleet validate --hidden-size) or set a number"
            )
            del data[key]
        else:
            errors.append(f"{dotted}: 'auto' cannot be resolved by the engine; {_auto_fix(key)}")
            del data[key]


def _auto_fix(key: str) -> str:
    if key == "enabled":
        return "set true or false"
    if key == "betas":
        return "set two numbers, e.g. [0.9, 0.999]"
    return "set a number"


# --------------------------------------------------------------------------- pydantic errors

_VARIANT_TAGS = set(OPTIMIZER_TYPES) | set(SCHEDULER_TYPES)
_KEYED_LINE = re.compile(r"^[A-Za-z0-9_.]+: ")


def _dotted(loc: tuple) -> str:
    parts = [str(p) for i, p in enumerate(loc) if not (i > 0 and loc[i - 1] in ("optimizer", "scheduler")
                                                           and p in _VARIANT_TAGS)]
    return ".".join(parts)


def _translate(error: dict) -> list[str]:
    key = _dotted(error["loc"])
    kind, ctx, value = error["type"], error.get("ctx", {}), error.get("input")
    if kind == "value_error":
        lines = str(ctx.get("error", error["msg"])).splitlines()
        out = []
        for line in lines:
            if _KEYED_LINE.match(line):  # a model-level check naming keys relative to `key`
                out.append(f"{key}.{line}" if key else line)
            else:
                out.append(f"{key or 'config'}: {line}")
        return out
    key = key or "config"
    if kind == "missing":
        return [f"{key}: missing (required); add it"]
    if kind == "extra_forbidden":
        return [f"{key}: unknown key; remove it"]
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return [f"{key}: must be {bounds[kind]} {limit}, got {value!r}; set a value {bounds[kind]} {limit}"]
    if kind == "literal_error":
        return [f"{key}: {value!r} is not allowed; use one of {ctx.get('expected')}"]
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return [f"{key}: expected an object (mapping), got {type(value).__name__} {value!r}; write {{...}}"]
    if kind in ("string_type",):
        return [f"{key}: expected a string, got {type(value).__name__} {value!r}; write a quoted string"]
    return [f"{key}: {error['msg']}; fix the value"]


# --------------------------------------------------------------------------- entry point


def load_config(
    source: dict | str | Path | DeepFleetConfig,
    *,
    world_size: int = 1,
    dp_size: int | None = None,
    hidden_size: int | None = None,
    auto_values: Mapping[str, Any] | None = None,
) -> DeepFleetConfig:
    """Parse, check and normalize a DeepSpeed-style config.

    `source`: a dict, a path to a .json/.yaml/.yml file, a JSON object string (or its base64, as
    DeepSpeed accepts), or an already loaded `DeepFleetConfig` (checked again). `world_size`:
    the number of ranks; `dp_size`: the data-parallel ranks among them (default: all of them, which is
    what they are when every other parallelism degree is 1), used to derive the batch triple
    (train_batch_size = micro * gas * dp_size). `hidden_size`: the model's hidden size,
    used to resolve HF-style `"auto"` bucket sizes. `auto_values`: values for other `"auto"` keys,
    by dotted key (what a trainer integration knows, e.g. `{"optimizer.params.lr": 3e-5}`); they
    replace only keys whose value is `"auto"` and are validated like the rest.
    Raises `ConfigError` listing every problem; warns `ConfigWarning` (one per key) for a ZeRO knob set
    to a non-default value at a stage that does not read it (see `config_zero`).
    """
    errors: list[str] = []
    if isinstance(source, DeepFleetConfig):  # re-resolve a loaded config, e.g. at another world size
        source = source.to_dict()
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError([f"world_size: must be a positive integer, got {world_size!r}; pass world_size >= 1"])
    if dp_size is not None and (isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1):
        raise ConfigError([f"dp_size: must be a positive integer, got {dp_size!r}; pass dp_size >= 1"])
    label, dp = ("world size", world_size) if dp_size is None else ("data-parallel size", dp_size)
    data = read_source(source, errors)
    if data is None:
        raise ConfigError(errors)
    stages = data.get("pipeline", {}).get("stages") if isinstance(data.get("pipeline"), dict) else None
    if dp_size is None and isinstance(stages, int) and not isinstance(stages, bool) and stages > 0 \
            and world_size % stages == 0 and stages > 1:
        # pipeline stages take a share of the ranks (engine/pipe/); the batch is split over the rest
        label, dp = "data-parallel size", world_size // stages
    _legacy_forms(data, errors)
    _canonical_type(data, "optimizer", OPTIMIZER_TYPES, OPTIMIZERS_NOT_SUPPORTED, errors)
    _canonical_type(data, "scheduler", SCHEDULER_TYPES, (), errors)
    check_keys(data, DeepFleetConfig, path="", errors=errors)
    apply_elasticity(data, dp_size=dp, errors=errors)  # sets the batch keys when elasticity is on
    # "pipeline.stages": "auto" is DeepSpeed's default: the PipelineModule's num_stages (engine/pipe/).
    fill = {"pipeline.stages": None, **(_hf_bucket_sizes(hidden_size) if hidden_size else {}),
            **dict(auto_values or {})}
    auto_batch: set[str] = set()
    _drop_auto_out_of_stage(data)
    _resolve_auto(data, path="", fill=fill, auto_batch=auto_batch, errors=errors)
    _raw_checks(data, world_size=dp, auto_batch=auto_batch, errors=errors, label=label)
    try:
        cfg = DeepFleetConfig.model_validate(data, context={"world_size": dp, "auto": auto_batch, "label": label})
    except ValidationError as e:
        for err in e.errors():
            errors.extend(_translate(err))
        cfg = None
    if errors:
        # Deduplicated (the raw checks and the model may say the same thing) and sorted by key.
        raise ConfigError(sorted(dict.fromkeys(errors)))
    for line in out_of_stage(cfg.zero_optimization):
        warnings.warn(ConfigWarning(line), stacklevel=2)
    return cfg
