"""The ZeRO section typed per stage (a knob another stage reads: silent at DeepSpeed's default or "auto",
a named ConfigWarning otherwise) and the DeepSpeed opt-outs accepted because they ask for what the engine
does anyway."""

from __future__ import annotations

import warnings

import pytest

from deepfleet.engine.config import ConfigError, ConfigWarning, load_config
from deepfleet.engine.config_zero import READ_AT_STAGES, ZeroConfig

BASE = {"train_micro_batch_size_per_gpu": 2}

# DeepSpeed-Chat's get_train_ds_config(offload=False, stage=2): stage-3 values written at every stage
DEEPSPEED_CHAT_STAGE2 = {
    **BASE,
    "zero_optimization": {
        "stage": 2, "offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"},
        "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False,
    },
    "fp16": {"enabled": True, "loss_scale_window": 100}, "gradient_clipping": 1.0, "prescale_gradients": False,
    "wall_clock_breakdown": False,
}


def _warnings(config: dict, **kwargs) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(config, **kwargs)
    assert all(issubclass(w.category, ConfigWarning) for w in caught), [str(w.message) for w in caught]
    return [str(w.message) for w in caught]


def test_knobs_of_other_stages_at_their_defaults_or_auto_are_silent() -> None:
    stage3_template = {  # HF's ZeRO-3 knobs, carried by a stage-2 config
        "sub_group_size": 1e9, "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    for stage in (0, 1, 2):  # no hidden size given: "auto" of a knob this stage ignores needs none
        load_config({**BASE, "zero_optimization": {"stage": stage, **stage3_template}})
    stage12_template = {"allgather_partitions": True, "allgather_bucket_size": 5e8, "reduce_scatter": True,
                        "round_robin_gradients": False}
    for stage in (0, 3):
        load_config({**BASE, "zero_optimization": {"stage": stage, **stage12_template}})


def test_deepspeed_chat_stage2_config_loads_and_names_each_stage3_value() -> None:
    lines = _warnings(DEEPSPEED_CHAT_STAGE2)
    assert lines == [
        "zero_optimization.stage3_prefetch_bucket_size: only stage 3 reads it (stage is 2), so 30000000 changes "
        "nothing; drop it or set zero_optimization.stage to 3",
        "zero_optimization.stage3_param_persistence_threshold: only stage 3 reads it (stage is 2), so 10000 "
        "changes nothing; drop it or set zero_optimization.stage to 3",
        "zero_optimization.stage3_max_live_parameters: only stage 3 reads it (stage is 2), so 30000000 changes "
        "nothing; drop it or set zero_optimization.stage to 3",
    ]
    assert _warnings({**DEEPSPEED_CHAT_STAGE2, "zero_optimization": {
        **DEEPSPEED_CHAT_STAGE2["zero_optimization"], "stage": 3}}) == []


@pytest.mark.parametrize("key", sorted(READ_AT_STAGES))
def test_every_stage_scoped_knob_is_named_at_a_stage_that_ignores_it(key: str) -> None:
    stages = READ_AT_STAGES[key]
    other = min({0, 1, 2, 3} - stages)
    default = ZeroConfig.model_fields[key].default
    value = (not default) if isinstance(default, bool) else 12345
    assert _warnings({**BASE, "zero_optimization": {"stage": min(stages), key: value}}) == []
    (line,) = _warnings({**BASE, "zero_optimization": {"stage": other, key: value}})
    assert line.startswith(f"zero_optimization.{key}: only stage") and f"(stage is {other})" in line


def test_short_alias_of_a_stage3_knob_is_named_by_its_field() -> None:
    (line,) = _warnings({**BASE, "zero_optimization": {"stage": 1, "max_live_parameters": 5}})
    assert line.startswith("zero_optimization.stage3_max_live_parameters: only stage 3 reads it (stage is 1)")


def test_an_out_of_stage_warning_can_be_made_an_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        with pytest.raises(ConfigWarning, match="stage3_max_reuse_distance"):
            load_config({**BASE, "zero_optimization": {"stage": 2, "stage3_max_reuse_distance": 7}})


OPT_OUTS = {  # dotted key -> the value that asks for what deepfleet does anyway
    "zero_optimization.memory_efficient_linear": False,
    "zero_optimization.override_module_apply": False,
    "zero_optimization.use_multi_rank_bucket_allreduce": False,
    "zero_optimization.elastic_checkpoint": True,
    "zero_force_ds_cpu_optimizer": False,
    "communication_data_type": "fp32",
    "dataloader_drop_last": True,
}
REFUSED = {  # the same keys at a value whose effect the engine lacks
    "zero_optimization.memory_efficient_linear": 1,
    "zero_optimization.override_module_apply": "no",
    "zero_optimization.use_multi_rank_bucket_allreduce": None,
    "zero_optimization.elastic_checkpoint": "yes",
    "zero_force_ds_cpu_optimizer": 0,
    "communication_data_type": "bf16",
    "dataloader_drop_last": "true",
}


def _with(key: str, value: object) -> dict:
    config = {**BASE, "zero_optimization": {"stage": 2}}
    section, _, leaf = key.rpartition(".")
    (config[section] if section else config)[leaf] = value
    return config


@pytest.mark.parametrize("key", sorted(OPT_OUTS))
def test_opt_outs_matching_the_engine_are_accepted_and_other_values_named(key: str) -> None:
    load_config(_with(key, OPT_OUTS[key]))
    with pytest.raises(ConfigError) as e:
        load_config(_with(key, REFUSED[key]))
    assert e.value.errors == [f"{key}: not supported yet; drop it"]


def test_offload_pin_memory_defaults_to_deepspeeds_true() -> None:
    cfg = load_config({**BASE, "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                     "offload_optimizer": {"device": "cpu"}}})
    assert cfg.zero_optimization.offload_param.pin_memory is True
    assert cfg.zero_optimization.offload_optimizer.pin_memory is True


def test_zero_keys_deepspeed_knows_are_not_unknown() -> None:
    load_config({**BASE, "zero_optimization": {"compute_grad_norm": True, "parameter_alignment": False}})
    with pytest.raises(ConfigError) as e:
        load_config({**BASE, "zero_optimization": {"compute_grad_norm": False}})
    assert e.value.errors == ["zero_optimization.compute_grad_norm: not supported yet; drop it"]
