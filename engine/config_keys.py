"""Key checks that run on the raw config dict before pydantic sees it.

Called by `deepfleet.engine.config.load_config`. Pydantic's `extra="forbid"` alone would say
"extra inputs are not permitted" for both a typo and a real DeepSpeed feature this engine lacks;
users need to know which one it is. This walk names every unknown key by its full dotted path with
a did-you-mean hint, tells DeepSpeed keys that are not implemented yet apart ("not supported
yet"), accepts such a key only when its value is DeepSpeed's default (so it changes nothing) or an
opt-out that asks for what this engine does anyway (`memory_efficient_linear: false`: plain
`nn.Linear`; `zero_force_ds_cpu_optimizer: false`: any optimizer under offload, ...; the reason sits
beside each rule), and removes the offending keys so that the remaining errors are still collected in the same pass.
Torch-free.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import AliasChoices, BaseModel


@dataclass(frozen=True)
class Unsupported:
    """A DeepSpeed key this engine does not implement: `harmless(value)` says when it changes nothing."""

    harmless: Callable[[Any], bool]
    fix: str = "drop it"


def _never(_: Any) -> bool:
    return False


def _equals(default: Any) -> Callable[[Any], bool]:
    # 1 == True in Python; a bool default only matches a bool.
    return lambda value: value == default and isinstance(value, bool) == isinstance(default, bool)


def _one_of(*values: Any) -> Callable[[Any], bool]:
    """DeepSpeed's default and the opt-out values that say what this engine does anyway."""
    checks = [_equals(v) for v in values]
    return lambda value: any(check(value) for check in checks)


def _all_off(defaults: dict[str, tuple]) -> Callable[[Any], bool]:
    """A section whose every key is known and set to one of its off values."""
    def check(value: Any) -> bool:
        return isinstance(value, dict) and all(
            key in defaults and any(_equals(off)(v) for off in defaults[key]) for key, v in value.items()
        )
    return check


def _disabled(value: Any) -> bool:
    return isinstance(value, dict) and value.get("enabled", False) is False


def _any(_: Any) -> bool:
    return True


_SECTION = Unsupported(_never, "drop the section")
_OFF = Unsupported(_disabled, 'drop the section or set "enabled": false')

# Dotted DeepSpeed keys that this engine does not implement yet.
NOT_SUPPORTED: dict[str, Unsupported] = {
    # top-level features
    # dynamic batching by token budget, with its learning-rate scaling
    "data_efficiency.data_sampling.dynamic_batching": _OFF,
    "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule": _OFF,  # DeepSpeed refuses it too
    "amp": _OFF,
    "quantize_training": _OFF,
    # gradients accumulate in fp32 (the strategies' buffers and FSDP2's reduce dtype), so only that is accepted
    "data_types": Unsupported(_all_off({"grad_accum_dtype": (None, "fp32")}),
                              'drop data_types or set "grad_accum_dtype": "fp32" (gradients accumulate in fp32)'),
    "hybrid_engine": _OFF,
    "nebula": _OFF,
    "weight_quantization": _SECTION,
    # AutoTP's other keys: overlapping its all-reduces, its inference-only and preset options
    "tensor_parallel.tp_overlap_comm": Unsupported(_equals(False)),
    "tensor_parallel.preset_model": Unsupported(_equals(None)),
    "tensor_parallel.injection_policy_tuple": Unsupported(_equals(None)),
    "tensor_parallel.keep_module_on_host": Unsupported(_equals(False)),
    "tensor_parallel.replace_with_kernel_inject": Unsupported(_equals(False)),
    "tensor_parallel.tp": Unsupported(_all_off({"tp_size": (1,), "tp_grain_size": (1, 64), "mpu": (None,),
                                                "tp_group": (None,)})),
    # the dtype DeepSpeed's tp_model_init casts the model to; training's precision is the bf16/fp16 sections
    "tensor_parallel.dtype": Unsupported(_any),
    "expert_parallel": _SECTION,
    "torch_autocast": _OFF,
    "communication_data_type": Unsupported(_one_of(None, "fp32")),  # every strategy reduces in fp32
    "sparse_gradients": Unsupported(_equals(False)),
    # DeepSpeed's choice of broadcast over all-gather to publish updated stage-1/2 partitions: the same values
    "disable_allgather": Unsupported(_one_of(False, True)),
    "memory_breakdown": Unsupported(_equals(False)),
    "graph_harvesting": Unsupported(_equals(False)),
    "dataloader_drop_last": Unsupported(_one_of(False, True)),  # our loader drops the last partial batch
    "zero_force_ds_cpu_optimizer": Unsupported(_one_of(True, False)),  # offload steps any torch optimizer
    "use_data_before_expert_parallelism": Unsupported(_equals(False)),
    # DeepSpeed only logs a warning about this key; it has no effect on training.
    "vocabulary_size": Unsupported(_any),
    # optimizer section
    "optimizer.legacy_fusion": Unsupported(_equals(False)),
    # DeepSpeed itself refuses this key at any value.
    "optimizer.params.set_grad_none": Unsupported(_equals(True)),
    "optimizer.params.amsgrad": Unsupported(_equals(False)),  # Lamb/Lion/SGD/Adagrad (Adam has the field)
    # precision sections
    "fp16.fp16_master_weights_and_grads": Unsupported(_equals(False)),
    "bf16.immediate_grad_update": Unsupported(_any),  # when master grads are updated; no numeric effect
    "bf16.check_grad_overflow": Unsupported(_equals(False)),
    "bf16.bf16_master_weights_and_grads": Unsupported(_equals(False)),
    "bf16.bf16_optimizer_states": Unsupported(_equals(False)),
    # zero_optimization
    "zero_optimization.elastic_checkpoint": Unsupported(_one_of(False, True)),  # loads at any world size
    "zero_optimization.load_from_fp32_weights": Unsupported(_equals(True)),
    "zero_optimization.ignore_unused_parameters": Unsupported(_equals(True)),
    "zero_optimization.compute_grad_norm": Unsupported(_equals(True)),  # the global norm is always computed
    "zero_optimization.parameter_alignment": Unsupported(_equals(False)),
    "zero_optimization.legacy_stage1": Unsupported(_equals(False)),
    # how DeepSpeed reduces buckets when reduce_scatter is off; the averaged gradients are the same either way
    "zero_optimization.use_multi_rank_bucket_allreduce": Unsupported(_one_of(True, False)),
    "zero_optimization.zero_hpz_partition_size": Unsupported(_equals(1)),
    "zero_optimization.zero_quantized_weights": Unsupported(_equals(False)),
    "zero_optimization.zero_quantized_nontrainable_weights": Unsupported(_equals(False)),
    "zero_optimization.zero_quantized_gradients": Unsupported(_equals(False)),
    "zero_optimization.zeropp_loco_param": Unsupported(_equals(None)),
    "zero_optimization.mics_shard_size": Unsupported(_equals(-1)),
    "zero_optimization.mics_hierarchical_params_gather": Unsupported(_equals(False)),
    "zero_optimization.memory_efficient_linear": Unsupported(_one_of(True, False)),  # plain nn.Linear
    "zero_optimization.pipeline_loading_checkpoint": Unsupported(_equals(False)),
    "zero_optimization.override_module_apply": Unsupported(_one_of(True, False)),  # Module.apply untouched
    "zero_optimization.log_trace_cache_warnings": Unsupported(_equals(False)),
    "zero_optimization.enable_sanity_checks": Unsupported(_equals(False)),
    "zero_optimization.zenflow": Unsupported(_equals(None)),
    "zero_optimization.leaf_module": _SECTION,
    # DeepSpeed's automatic ZeRO-3 leaf marking of small modules, a hook-overhead setting; stage 3 here gathers
    # per block already (mark leaves explicitly with deepspeed.utils.set_z3_leaf_modules)
    "zero_optimization.stage3_module_granularity_threshold": Unsupported(_any),
    "zero_optimization.module_granularity_threshold": Unsupported(_equals(0)),
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": Unsupported(_equals(False)),
    "zero_optimization.stage3_allgather_sequential": Unsupported(_equals(False)),
    "zero_optimization.stage3_partition_stream_chunk_size": Unsupported(_equals(0)),
    "zero_optimization.save_muon_momentum_buffer_in_memory": Unsupported(_equals(False)),
    "zero_optimization.offload_optimizer.super_offload": Unsupported(_equals(False)),
    "zero_optimization.offload_optimizer.convert_grad_on_cpu": Unsupported(_equals(True)),
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": Unsupported(_equals(0.8)),
}


def accepted_keys(model: type[BaseModel]) -> dict[str, Any]:
    """Every key a model accepts (field names and validation aliases) -> the field's annotation."""
    keys: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        keys[name] = field.annotation
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            for choice in alias.choices:
                if isinstance(choice, str):
                    keys[choice] = field.annotation
        elif isinstance(alias, str):
            keys[alias] = field.annotation
    return keys


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models_in(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _dict_entry_model(annotation: Any) -> type[BaseModel] | None:
    """The section model of a `dict[str, Section]` field's values, else None."""
    if typing.get_origin(annotation) is dict:
        models = _models_in(typing.get_args(annotation)[1])
        return models[0] if len(models) == 1 else None
    return None


def section_model(annotation: Any, value: Any) -> type[BaseModel] | None:
    """The model a nested dict validates against; for a union on `type`, the variant `value` names."""
    models = _models_in(annotation)
    if len(models) == 1:
        return models[0]
    if isinstance(value, dict):
        for model in models:
            tag = model.model_fields.get("type")
            if tag is not None and tag.default == value.get("type"):
                return model
    return None


def check_keys(data: dict, model: type[BaseModel], *, path: str, errors: list[str]) -> None:
    """Remove unknown and not-yet-supported keys from `data` (in place), appending one error line each."""
    accepted = accepted_keys(model)
    for field in model.model_fields.values():  # two spellings of one setting: keep the first
        if isinstance(field.validation_alias, AliasChoices):
            present = [c for c in field.validation_alias.choices if isinstance(c, str) and c in data]
            for extra in present[1:]:
                errors.append(f"{path}{extra}: same setting as {path}{present[0]}; keep only one of them")
                del data[extra]
    for key in list(data):
        value = data[key]
        dotted = f"{path}{key}"
        if key in accepted:
            sub = section_model(accepted[key], value)
            if sub is not None and isinstance(value, dict):
                check_keys(value, sub, path=dotted + ".", errors=errors)
            entry = _dict_entry_model(accepted[key])
            if entry is not None and isinstance(value, dict):  # a named map of sections (curriculum_metrics)
                for name, item in value.items():
                    if isinstance(item, dict):
                        check_keys(item, entry, path=f"{dotted}.{name}.", errors=errors)
            continue
        del data[key]
        rule = NOT_SUPPORTED.get(dotted)
        if rule is not None:
            if not rule.harmless(value):
                errors.append(f"{dotted}: not supported yet; {rule.fix}")
            continue
        siblings = [k[len(path):] for k in NOT_SUPPORTED if k.startswith(path) and "." not in k[len(path):]]
        close = difflib.get_close_matches(str(key), [*accepted, *siblings], n=1, cutoff=0.6)
        hint = f"did you mean {path}{close[0]}? " if close else ""
        errors.append(f"{dotted}: unknown key; {hint}remove or rename it")
