"""deepfleet.engine.config: defaults, batch arithmetic, sources, aliases and the error lines."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from deepfleet.engine.config import ConfigError, DeepFleetConfig, load_config


def _errors(source, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(source, **kwargs)
    return info.value.errors


def test_defaults_match_deepspeed_code_defaults() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 2})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (2, 2, 1)
    assert cfg.optimizer is None and cfg.scheduler is None
    fp16 = cfg.fp16
    assert (fp16.enabled, fp16.auto_cast, fp16.loss_scale, fp16.initial_scale_power) == (False, False, 0.0, 16)
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.consecutive_hysteresis, fp16.min_loss_scale) == (
        1000, 2, False, 1.0)
    assert cfg.bf16.enabled is False
    assert cfg.gradient_clipping == 0.0
    zero = cfg.zero_optimization
    assert zero.stage == 0 and zero.overlap_comm is False
    assert zero.reduce_bucket_size == 500_000_000 and zero.allgather_bucket_size == 500_000_000
    assert zero.contiguous_gradients and zero.reduce_scatter and zero.allgather_partitions
    assert zero.round_robin_gradients is False and zero.sub_group_size == 1_000_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000 and zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_live_parameters == 1_000_000_000 and zero.stage3_max_reuse_distance == 1_000_000_000
    assert zero.offload_param is None and zero.offload_optimizer is None
    assert cfg.steps_per_print is None and cfg.wall_clock_breakdown is False
    assert cfg.prescale_gradients is False and cfg.gradient_predivide_factor == 1.0
    assert cfg.zero_allow_untested_optimizer is False and cfg.dump_state is False


def test_overlap_comm_defaults_to_true_at_stage_3_only() -> None:
    assert load_config({"train_batch_size": 4, "zero_optimization": {"stage": 3}}).zero_optimization.overlap_comm
    two = load_config({"train_batch_size": 4, "zero_optimization": {"stage": 2}})
    assert two.zero_optimization.overlap_comm is False


@pytest.mark.parametrize(
    ("given", "world_size", "expected"),
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2, (24, 4, 3)),
        ({"train_batch_size": 12}, 3, (12, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 5}, 2, (10, 5, 1)),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 2,
         (16, 4, 2)),
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto"}, 2,
         (8, 4, 1)),
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 3,
         (24, 2, 4)),
    ],
)
def test_batch_triple_is_derived(given: dict, world_size: int, expected: tuple) -> None:
    cfg = load_config(given, world_size=world_size)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


def test_inconsistent_batch_triple_shows_the_arithmetic() -> None:
    errors = _errors(
        {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, world_size=2
    )
    assert errors == [
        "train_batch_size: 32 != 4 (micro) * 2 (gas) * 2 (world size) = 16; fix one of the three or drop train_batch_size"
    ]


def test_indivisible_and_missing_batch_sizes() -> None:
    assert _errors({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, world_size=2)[0].startswith(
        "train_batch_size: 30 is not divisible by 4 (micro) * 2 (world size) = 8;")
    assert _errors({"gradient_accumulation_steps": 2})[0].startswith("train_micro_batch_size_per_gpu: missing;")
    assert _errors({"train_micro_batch_size_per_gpu": 0})[0].startswith("train_micro_batch_size_per_gpu: must be > 0")


def test_all_errors_are_collected_one_line_each() -> None:
    errors = _errors({
        "train_batch_size": 8,
        "fp16": {"enabled": True},
        "bf16": {"enabled": True},
        "gradient_clip": 1.0,
        "hybrid_engine": {"enabled": True},
        "optimizer": {"type": "adam", "params": {"lr": "auto", "momentum": 0.9}},
        "zero_optimization": {"stage": 5, "reduce_bucket_size": -1},
        "steps_per_print": "10",
    })
    assert errors == [  # sorted by key
        "fp16.enabled: fp16 and bf16 are both enabled; enable only one of them",
        "gradient_clip: unknown key; did you mean gradient_clipping? remove or rename it",
        'hybrid_engine: not supported yet; drop the section or set "enabled": false',
        "optimizer.params.lr: 'auto' cannot be resolved by the engine; set a number",
        "optimizer.params.momentum: unknown key; remove or rename it",
        "steps_per_print: expected an integer, got str '10'; write a number without quotes",
        "zero_optimization.reduce_bucket_size: must be > 0, got -1; set a value > 0",
        "zero_optimization.stage: 5 is out of range; use 0, 1, 2 or 3",
    ]
    assert all("\n" not in line for line in errors)


def test_sources_dict_json_string_json_file_yaml_file(tmp_path) -> None:
    raw = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}}
    as_json = tmp_path / "ds.json"
    as_json.write_text(json.dumps(raw))
    as_yaml = tmp_path / "ds.yaml"
    as_yaml.write_text("train_micro_batch_size_per_gpu: 2\nzero_optimization:\n  stage: 2\n  reduce_bucket_size: 2e8\n")
    results = [load_config(s).to_dict() for s in (raw, json.dumps(raw), str(as_json), as_json, as_yaml)]
    assert all(r == results[0] for r in results)
    assert results[0]["zero_optimization"]["reduce_bucket_size"] == 200_000_000
    assert raw["zero_optimization"]["reduce_bucket_size"] == 2e8  # the caller's dict is not modified


def test_malformed_files_name_file_line_and_column(tmp_path) -> None:
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}\n')
    [line] = _errors(bad_json)
    assert line.startswith(f"{bad_json}:3:") and "invalid JSON" in line
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("train_batch_size: 8\nfp16:\n  enabled: [true\n")
    [line] = _errors(bad_yaml)
    assert line.startswith(f"{bad_yaml}:") and "invalid YAML" in line
    assert _errors('{"train_batch_size": 8,}')[0].startswith("config: invalid JSON at line 1 column")
    assert _errors(tmp_path / "missing.json")[0].startswith("config: file not found:")
    assert _errors(tmp_path)[0].startswith(f"config: {tmp_path} is not a file;")
    not_a_mapping = tmp_path / "list.json"
    not_a_mapping.write_text("[1]")
    assert _errors(not_a_mapping) == [f"config: {not_a_mapping} holds a list, not an object; write a JSON/YAML mapping"]


def test_duplicate_json_keys_are_rejected() -> None:
    assert _errors('{"train_batch_size": 8, "train_batch_size": 16}') == [
        "train_batch_size: duplicate key in the JSON string; keep only one"
    ]


def test_bfloat16_alias_and_both_spellings() -> None:
    assert load_config({"train_batch_size": 1, "bfloat16": {"enabled": True}}).bf16.enabled is True
    assert _errors({"train_batch_size": 1, "bf16": {}, "bfloat16": {}}) == [
        "bfloat16: same setting as bf16; keep only one of them"
    ]
    assert _errors({"train_batch_size": 1, "zero_optimization": {"prefetch_bucket_size": 7,
                                                                 "stage3_prefetch_bucket_size": 5}}) == [
        "zero_optimization.prefetch_bucket_size: same setting as zero_optimization.stage3_prefetch_bucket_size; "
        "keep only one of them"
    ]
    short = load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3, "max_live_parameters": 7}})
    assert short.zero_optimization.stage3_max_live_parameters == 7


def test_auto_bucket_sizes_resolve_from_hidden_size() -> None:
    zero = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto"}
    cfg = load_config({"train_batch_size": 2, "zero_optimization": zero}, hidden_size=1024)
    z = cfg.zero_optimization
    assert (z.reduce_bucket_size, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        1024 * 1024, int(0.9 * 1024 * 1024), 10 * 1024)
    errors = _errors({"train_batch_size": 2, "zero_optimization": zero})
    assert len(errors) == 3 and all("'auto' needs the model's hidden size" in e for e in errors)


def test_not_supported_key_with_default_value_is_accepted_and_other_values_named() -> None:
    ok = {"train_batch_size": 2, "zero_optimization": {"stage": 2, "load_from_fp32_weights": True},
          "wandb": {"enabled": False}, "communication_data_type": None}
    load_config(ok)
    errors = _errors({"train_batch_size": 2, "zero_optimization": {"stage": 2, "load_from_fp32_weights": False},
                      "hybrid_engine": {"enabled": True}})
    assert errors == [
        'hybrid_engine: not supported yet; drop the section or set "enabled": false',
        "zero_optimization.load_from_fp32_weights: not supported yet; drop it",
    ]


def test_nvme_offload_is_accepted_and_offload_needs_the_right_stage() -> None:
    param = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 3, "buffer_size": 1000, "max_in_cpu": 0,
        "pin_memory": True}}}).zero_optimization.offload_param
    assert (param.device, param.nvme_path, param.buffer_count, param.buffer_size, param.max_in_cpu) == (
        "nvme", "/local_nvme", 3, 1000, 0)
    assert _errors({"train_batch_size": 2, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu", "max_in_cpu": 10}}}) == [
        'zero_optimization.offload_param.max_in_cpu: only read with device "nvme"; drop it or set device to "nvme"']
    assert _errors({"train_batch_size": 2, "zero_optimization": {
        "stage": 1, "offload_optimizer": {"device": "cpu", "nvme_path": "/local_nvme"}}}) == [
        'zero_optimization.offload_optimizer.nvme_path: only read with device "nvme"; drop it or set device to "nvme"']
    cfg = load_config({"train_batch_size": 2, "zero_optimization": {"stage": 1, "sub_group_size": 10, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 2, "pipeline_read": True}},
        "aio": {"block_size": 4096, "thread_count": 2}})
    assert cfg.zero_optimization.offload_optimizer.device == "nvme" and cfg.aio.thread_count == 2
    assert _errors({"train_batch_size": 2, "aio": {"use_gds": True}}) == [
        "aio.use_gds: GPUDirect Storage is not supported yet; drop it or set it to false"]
    assert _errors({"train_batch_size": 2, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}})[0].startswith(
        "zero_optimization.offload_optimizer: optimizer offload needs stage 1, 2 or 3")
    cfg = load_config({"train_batch_size": 2, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}, "offload_optimizer": {"device": "cpu"}}})
    assert cfg.zero_optimization.offload_param.device == "cpu" and cfg.zero_optimization.offload_param.pin_memory


def test_wrong_types_are_not_coerced() -> None:
    errors = _errors({"train_batch_size": 2, "fp16": {"enabled": "yes"}, "gradient_clipping": True,
                      "zero_optimization": {"stage": 1.5}, "seed": [1]})
    assert errors == [
        "fp16.enabled: expected true or false, got str 'yes'; write true or false without quotes",
        "gradient_clipping: expected a number, got bool True; write a number without quotes",
        "seed: expected an integer, got list [1]; write a number without quotes",
        "zero_optimization.stage: expected an integer, got 1.5; use a whole number",
    ]
    assert _errors({"train_batch_size": 2, "fp16": 1}) == [
        "fp16: expected an object (mapping), got int 1; write {...}"
    ]


def test_model_dump_round_trips() -> None:
    cfg = load_config({"train_batch_size": 8, "optimizer": {"type": "Lion"}, "scheduler": {
        "type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}}, world_size=2)
    again = load_config(cfg.to_dict(), world_size=2)
    assert again == cfg
    assert isinstance(again, DeepFleetConfig)
    assert load_config(cfg, world_size=2) == cfg
    assert _errors(cfg, world_size=4) == [
        "train_batch_size: 8 != 4 (micro) * 1 (gas) * 4 (world size) = 16; fix one of the three or drop train_batch_size"
    ]


def test_config_imports_without_torch() -> None:
    code = textwrap.dedent("""
        import sys
        class _Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked")
        sys.meta_path.insert(0, _Block())
        from deepfleet.engine.config import load_config
        cfg = load_config({"train_batch_size": 4, "optimizer": {"type": "AdamW"}})
        assert "torch" not in sys.modules
        print(cfg.optimizer.type)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "AdamW"


def test_duplicate_yaml_keys_are_rejected_with_their_position(tmp_path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text("train_batch_size: 8\nzero_optimization:\n  stage: 2\n  stage: 3\n")
    assert _errors(path) == [f"{path}:4:3: duplicate key 'stage'; keep only one"]


def test_base64_json_string_like_deepspeed() -> None:
    import base64

    encoded = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 6}).encode()).decode()
    assert load_config(encoded, world_size=3).train_micro_batch_size_per_gpu == 2


def _sections(model, seen=None):
    """Every config model reachable from `model` (fields, optionals and union variants)."""
    import typing

    from pydantic import BaseModel

    seen = set() if seen is None else seen
    if model in seen:
        return seen
    seen.add(model)
    for field in model.model_fields.values():
        stack = [field.annotation]
        while stack:
            ann = stack.pop()
            stack.extend(typing.get_args(ann))
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                _sections(ann, seen)
    return seen


def test_every_field_of_every_section_has_a_docstring() -> None:
    sections = _sections(DeepFleetConfig)
    assert len(sections) > 20  # top level, precision, zero, offload, 6 optimizers, 5 schedules and their params
    missing = [f"{m.__name__}.{name}" for m in sections for name, f in m.model_fields.items() if not f.description]
    assert missing == []


def test_optimizer_and_scheduler_sections() -> None:
    cfg = load_config({"train_batch_size": 1, "optimizer": {"type": "lamb", "params": {"amsgrad": False}},
                       "scheduler": {"type": "onecycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 0.2}}})
    assert (cfg.optimizer.type, cfg.scheduler.type) == ("Lamb", "OneCycle")
    p = cfg.scheduler.params
    assert (p.cycle_first_step_size, p.cycle_second_step_size, p.cycle_momentum, p.cycle_min_mom, p.cycle_max_mom) == (
        2000, None, True, 0.8, 0.9)
    assert _errors({"train_batch_size": 1, "optimizer": {"type": "Lion", "params": {"amsgrad": True}},
                    "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.3, "cycle_max_lr": 0.2}}}) == [
        "optimizer.params.amsgrad: not supported yet; drop it",
        "scheduler.params.cycle_min_lr: 0.3 > cycle_max_lr 0.2; swap them",
    ]
    assert _errors({"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}) == [
        'optimizer.params.adam_w_mode: false contradicts type AdamW (always decoupled weight decay); use "type": '
        '"Adam" for L2-coupled decay or drop adam_w_mode'
    ]
    assert _errors({"train_batch_size": 1, "scheduler": {"type": "WarmupCosineLR", "params": {}}}) == [
        "scheduler.params.total_num_steps: missing (required); add it"
    ]
    assert _errors({"train_batch_size": 1, "optimizer": {"type": "Adamm"}}) == [
        "optimizer.type: unknown optimizer 'Adamm'; did you mean 'Adam'? use one of Adam, AdamW, SGD, Adagrad, Lamb, "
        "Lion, OneBitAdam, ZeroOneAdam, OneBitLamb"
    ]
    assert _errors({"train_batch_size": 1, "gradient_clipping": 2.0,
                    "optimizer": {"type": "adam", "params": {"max_grad_norm": 1.0}}}) == [
        "optimizer.params.max_grad_norm: 1.0 contradicts gradient_clipping: 2.0; keep only gradient_clipping"
    ]


def test_auto_values_fill_only_auto_keys_and_are_validated() -> None:
    raw = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}}
    fill = {"optimizer.params.lr": 3e-5, "optimizer.params.betas": [0.9, 0.95], "train_micro_batch_size_per_gpu": 4,
            "gradient_clipping": 9.0}
    cfg = load_config(raw, world_size=2, auto_values=fill)
    assert (cfg.optimizer.params.lr, cfg.optimizer.params.betas) == (3e-5, (0.9, 0.95))
    assert (cfg.train_batch_size, cfg.gradient_clipping) == (8, 0.5)  # gradient_clipping was not "auto"
    assert _errors(raw, auto_values={**fill, "optimizer.params.lr": "fast"}) == [
        "optimizer.params.lr: expected a number, got str 'fast'; write a number without quotes"
    ]


def test_strings_that_cannot_be_paths_are_one_line_errors() -> None:
    [line] = _errors("a" * 5000)
    assert line.startswith("config: 'aaaa") and "(5000 characters)' is not a usable path" in line
    assert _errors("ds\x00config.json") == [
        "config: file not found: ds\\x00config.json; pass a path to a .json/.yaml file or a JSON object string"
    ]


def test_schedule_rates_may_be_one_per_group() -> None:
    cfg = load_config({"train_batch_size": 1, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": [0, 1e-5], "warmup_max_lr": 3e-4}}})
    assert (cfg.scheduler.params.warmup_min_lr, cfg.scheduler.params.warmup_max_lr) == ([0.0, 1e-5], 3e-4)
    assert _errors({"train_batch_size": 1, "scheduler": {"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": [0.1, -1]}}}) == [
        "scheduler.params.lr_range_test_min_lr: must be >= 0, got -1; set a non-negative learning rate"
    ]
