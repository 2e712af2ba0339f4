"""`deepfleet validate`, run as a subprocess: broken configs give one line per problem and exit 2, never a
traceback; realistic DeepSpeed configs (HF Trainer, Megatron-style, DeepSpeedExamples-style) parse unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _validate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepfleet.controller.cli", "validate", *args],
                          capture_output=True, text=True, timeout=120)


def _write(tmp_path: Path, name: str, content: dict | str) -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content, indent=2))
    return str(path)


BASE = {"train_micro_batch_size_per_gpu": 4}

# (id, config file name, content, extra args, expected stderr lines; "{path}" is the file's path)
BROKEN = [
    ("wrong-types", "c.json", {**BASE, "fp16": {"enabled": "true"}, "gradient_clipping": "1.0"}, [], [
        "fp16.enabled: expected true or false, got str 'true'; write true or false without quotes",
        "gradient_clipping: expected a number, got str '1.0'; write a number without quotes",
    ]),
    ("inconsistent-batch", "c.json",
     {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     ["--world-size", "2"], [
        "train_batch_size: 32 != 4 (micro) * 2 (gas) * 2 (world size) = 16; "
        "fix one of the three or drop train_batch_size",
    ]),
    ("unknown-key", "c.json", {**BASE, "zero_optimization": {"stage": 2, "reduce_bucket_sise": 1000}}, [], [
        "zero_optimization.reduce_bucket_sise: unknown key; did you mean zero_optimization.reduce_bucket_size? "
        "remove or rename it",
    ]),
    ("unsupported-optimizer", "c.json", {**BASE, "optimizer": {"type": "Muon", "params": {"lr": 1e-3}}}, [], [
        "optimizer.type: 'Muon' is not supported yet; use one of Adam, AdamW, SGD, Adagrad, Lamb, Lion, "
        "OneBitAdam, ZeroOneAdam, OneBitLamb",
    ]),
    ("negative-bucket", "c.json", {**BASE, "zero_optimization": {"stage": 1, "allgather_bucket_size": -5}}, [], [
        "zero_optimization.allgather_bucket_size: must be > 0, got -5; set a value > 0",
    ]),
    ("malformed-json", "c.json", '{\n  "train_batch_size": 8\n  "fp16": {}\n}\n', [], [
        "{path}:3:3: invalid JSON: Expecting ',' delimiter; fix the JSON syntax there",
    ]),
    ("malformed-yaml", "c.yaml", "train_batch_size: 8\nzero_optimization:\n  stage: 2\n reduce_bucket_size: 5\n", [], [
        "{path}:4:2: invalid YAML: expected <block end>, but found '<block mapping start>'; fix the YAML syntax there",
    ]),
    ("auto-unresolvable", "c.json", {**BASE, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, [], [
        "optimizer.params.lr: 'auto' cannot be resolved by the engine; set a number",
    ]),
    ("auto-bucket-without-hidden-size", "c.json", {**BASE, "zero_optimization": {"reduce_bucket_size": "auto"}}, [], [
        "zero_optimization.reduce_bucket_size: 'auto' needs the model's hidden size; pass hidden_size to "
        "load_config (deepfleet validate --hidden-size) or set a number",
    ]),
    ("not-supported-yet", "c.json", {**BASE, "hybrid_engine": {"enabled": True},
                                     "zero_optimization": {"stage": 1, "offload_optimizer": {"ratio": 0.5}}}, [], [
        'hybrid_engine: not supported yet; drop the section or set "enabled": false',
        "zero_optimization.offload_optimizer.ratio: partial offload is not supported yet; drop it or use 1.0",
    ]),
    ("fp16-and-bf16", "c.json", {**BASE, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, [], [
        "fp16.enabled: fp16 and bf16 are both enabled; enable only one of them",
    ]),
    ("offload-param-without-stage-3", "c.yaml",
     "train_batch_size: 8\nzero_optimization:\n  stage: 2\n  offload_param:\n    device: cpu\n", [], [
        "zero_optimization.offload_param: parameter offload needs stage 3 (stage is 2); "
        "set zero_optimization.stage to 3 or drop offload_param",
    ]),
    ("stage-out-of-range", "c.json", {**BASE, "zero_optimization": {"stage": 4}}, [], [
        "zero_optimization.stage: 4 is out of range; use 0, 1, 2 or 3",
    ]),
    ("top-level-list", "c.json", "[1, 2]", [], [
        "config: {path} holds a list, not an object; write a JSON/YAML mapping",
    ]),
]


@pytest.mark.parametrize(("name", "content", "args", "expected"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_broken_configs_give_one_line_per_error(tmp_path, name, content, args, expected) -> None:
    path = _write(tmp_path, name, content)
    result = _validate(path, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.splitlines() == [line.replace("{path}", path) for line in expected]


def test_inputs_that_are_not_config_files(tmp_path) -> None:
    cases = {
        str(tmp_path / "missing.json"): f"config: file not found: {tmp_path / 'missing.json'}; pass a path to a "
                                        ".json/.yaml file or a JSON object string",
        str(tmp_path): f"config: {tmp_path} is not a file; pass a .json/.yaml config file",
        '{"train_batch_size": }': "config: invalid JSON at line 1 column 22: Expecting value; fix the JSON syntax there",
    }
    for arg, line in cases.items():
        result = _validate(arg)
        assert (result.returncode, result.stderr.splitlines()) == (2, [line])
        assert "Traceback" not in result.stdout + result.stderr
    bad_option = _validate(_write(tmp_path, "ok.json", BASE), "--world-size", "zero")
    assert bad_option.returncode == 2 and "Traceback" not in bad_option.stdout + bad_option.stderr
    assert "world-size" in bad_option.stderr


HF_ZERO2_TEMPLATE = {  # HF Trainer's ZeRO-2 template as published, every trainer-specific value "auto"
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                  "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
# What the HF Trainer fills those "auto"s with, given as `--auto KEY=VALUE`.
HF_AUTO_VALUES = [
    "--auto", "fp16.enabled=true", "--auto", "bf16.enabled=false", "--auto", "optimizer.params.lr=5e-5",
    "--auto", "optimizer.params.betas=[0.9, 0.999]", "--auto", "optimizer.params.eps=1e-8",
    "--auto", "optimizer.params.weight_decay=0.0", "--auto", "gradient_clipping=1.0",
    "--auto", "train_micro_batch_size_per_gpu=8", "--auto", "gradient_accumulation_steps=2",
    "--auto", "scheduler.params.warmup_min_lr=0", "--auto", "scheduler.params.warmup_max_lr=5e-5",
    "--auto", "scheduler.params.warmup_num_steps=500",
]


def test_full_hf_template_names_every_auto_the_engine_cannot_fill(tmp_path) -> None:
    result = _validate(_write(tmp_path, "hf.json", HF_ZERO2_TEMPLATE))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert [line.split(":")[0] for line in result.stderr.splitlines()] == [
        "bf16.enabled", "fp16.enabled", "gradient_accumulation_steps", "gradient_clipping",
        "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.lr", "optimizer.params.weight_decay",
        "scheduler.params.warmup_max_lr", "scheduler.params.warmup_min_lr", "scheduler.params.warmup_num_steps",
        "train_batch_size", "train_micro_batch_size_per_gpu",
    ]


# --------------------------------------------------------------------------- real-world configs

HF_ZERO2_FILLED = {  # HF Trainer's ZeRO-2 template with the trainer-specific "auto"s written in
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": False},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 500}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": 1.0, "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 8, "wall_clock_breakdown": False,
}
HF_ZERO3 = {  # HF Trainer's ZeRO-3 template: bucket sizes "auto" from the hidden size, full offload
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10000, "warmup_min_lr": 0,
                                                       "warmup_max_lr": 2e-5, "warmup_num_steps": 300}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": 4, "gradient_clipping": 1.0, "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": False,
}
MEGATRON_BF16_STAGE1 = {
    "train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
    "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "prescale_gradients": False,
    "bf16": {"enabled": True}, "wall_clock_breakdown": False, "zero_allow_untested_optimizer": True,
}
FP16_STAGE2_OFFLOAD = {
    "train_batch_size": 64, "gradient_accumulation_steps": 2,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 20000, "warmup_max_lr": 0.00015,
                                                       "warmup_num_steps": 2000, "warmup_type": "linear"}},
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1,
             "initial_scale_power": 12},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "contiguous_gradients": True, "overlap_comm": True, "reduce_scatter": True,
                          "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "round_robin_gradients": True},
    "gradient_clipping": 1.0, "steps_per_print": 100, "wall_clock_breakdown": False,
}
BERT_LAMB = {  # DeepSpeed's BERT pre-training recipe shape: LAMB, fp16, large batch
    "train_batch_size": 4096, "train_micro_batch_size_per_gpu": 64, "steps_per_print": 1000,
    "prescale_gradients": False, "gradient_clipping": 1.0, "wall_clock_breakdown": False,
    "optimizer": {"type": "Lamb", "params": {"lr": 11e-3, "weight_decay": 0.01, "bias_correction": False,
                                             "max_coeff": 0.3, "min_coeff": 0.01}},
    "fp16": {"enabled": True, "loss_scale": 0, "min_loss_scale": 1},
}
LEGACY_OFFLOAD = {  # the older spellings 2020-2022 configs carry (Megatron-DeepSpeed, BingBertSquad)
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "zero_optimization": {
        "stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True, "elastic_checkpoint": True,
        "stage3_module_granularity_threshold": 0},
    "optimizer": {"type": "Adam", "params": {"lr": 3e-5, "bias_correction": False, "max_grad_norm": 1.0}},
    "disable_allgather": True, "dataloader_drop_last": True, "data_types": {"grad_accum_dtype": "fp32"},
    "bf16": {"enabled": True},
}
GPT_RANDOM_LTD = {  # DeepSpeed's data-efficiency GPT recipe shape: random-LTD on the middle layers
    "train_batch_size": 512, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 10,
    "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0, "bf16": {"enabled": True},
    "data_efficiency": {
        "enabled": True, "seed": 1234,
        "data_sampling": {"enabled": False, "num_workers": 0},
        "data_routing": {"enabled": True, "random_ltd": {
            "enabled": True, "total_layer_num": 24, "random_ltd_layer_num": 22,
            "random_ltd_layer_id": list(range(1, 23)), "model_mask_name": "attention_mask",
            "model_type": "decoder", "hidden_state_order": "seq_batch_dim",
            "random_ltd_schedule": {"min_value": 128, "max_value": 2048, "schedule_type": "fixed_linear",
                                    "schedule_config": {"require_steps": 200000, "seq_per_step": 16}}}}},
    "eigenvalue": {"enabled": True, "max_iter": 50, "tol": 1e-2, "layer_name": "transformer.h", "layer_num": 24},
}
GPT_DATA_CURRICULUM = {  # DeepSpeed's data-efficiency GPT recipe shape: curriculum on seqlen and vocab rarity
    "train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
    "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "fp16": {"enabled": False},
    "data_efficiency": {
        "enabled": True, "seed": 1234,
        "data_sampling": {
            "enabled": True, "num_epochs": 1, "num_workers": 0,
            "curriculum_learning": {
                "enabled": True, "data_cluster_path": "/data/gpt/curriculum_clusters",
                "curriculum_metrics": {
                    "vocabularyrarity": {
                        "index_to_sample_path": "/data/gpt/analysis/vocabularyrarity/vocabularyrarity_index_to_sample_percentile_merged",
                        "index_to_metric_path": "/data/gpt/analysis/vocabularyrarity/vocabularyrarity_index_to_metric",
                        "difficulty_type": "percentile", "clustering_type": "schedule_based",
                        "min_difficulty": 1, "max_difficulty": 100, "schedule_type": "fixed_root",
                        "schedule_config": {"total_curriculum_step": 110000, "difficulty_step": 1, "root_degree": 2}},
                    "seqlen_truncate": {
                        "index_to_sample_path": "/data/gpt/analysis/seqlen/seqlen_index_to_sample",
                        "index_to_metric_path": "/data/gpt/analysis/seqlen/seqlen_index_to_metric",
                        "difficulty_type": "value", "clustering_type": "single_cluster",
                        "min_difficulty": 80, "max_difficulty": 2048, "schedule_type": "fixed_linear",
                        "schedule_config": {"total_curriculum_step": 110000, "difficulty_step": 8}}}}},
        "data_routing": {"enabled": False}},
}
AUTOTP_ZERO1 = {  # DeepSpeed's AutoTP training tutorial shape: tensor parallel 4 beside ZeRO-1, bf16
    "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
    "tensor_parallel": {"autotp_size": 4},
    "zero_optimization": {"stage": 1, "gather_16bit_weights_on_model_save": True},
    "bf16": {"enabled": True}, "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
}
ELASTIC = {  # DeepSpeed Elasticity's documented example, with ZeRO-1 and fp16
    "elasticity": {"enabled": True, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 1,
                   "max_gpus": 10000, "min_time": 20, "version": 0.1},
    "zero_optimization": {"stage": 1}, "fp16": {"enabled": True},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
}
BOOLEAN_ZERO = {"train_batch_size": 16, "zero_optimization": False, "fp16": {"enabled": False},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
YAML_ONECYCLE = """\
train_micro_batch_size_per_gpu: 16
gradient_accumulation_steps: 1
optimizer:
  type: sgd
  params: {lr: 0.05, momentum: 0.9, weight_decay: 5.0e-4}
scheduler:
  type: OneCycle
  params:
    cycle_min_lr: 0.005
    cycle_max_lr: 0.05
    cycle_first_step_size: 1000
    cycle_momentum: true
bfloat16:
  enabled: false
tensorboard:
  enabled: false
  output_path: runs/
zero_optimization:
  stage: 0
  reduce_bucket_size: 5e8
"""

REAL = [
    ("hf-zero2-template-unchanged", "ds.json", HF_ZERO2_TEMPLATE, ["--world-size", "2", *HF_AUTO_VALUES],
     {"train_batch_size": 32, "optimizer.params.lr": 5e-5, "fp16.enabled": True, "gradient_clipping": 1.0}),
    ("hf-zero2-offload-fp16", "ds.json", HF_ZERO2_FILLED, ["--world-size", "4"],
     {"train_batch_size": 32, "gradient_accumulation_steps": 1}),
    ("hf-zero3-auto-buckets", "ds.json", HF_ZERO3, ["--world-size", "8", "--hidden-size", "4096"],
     {"train_batch_size": 64, "zero_optimization.reduce_bucket_size": 4096 * 4096,
      "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * 4096 * 4096),
      "zero_optimization.stage3_param_persistence_threshold": 40960}),
    ("megatron-bf16-stage1", "ds.json", MEGATRON_BF16_STAGE1, ["--world-size", "8"],
     {"gradient_accumulation_steps": 8, "bf16.enabled": True}),
    ("fp16-stage2-offload-cpu", "ds.json", FP16_STAGE2_OFFLOAD, ["--world-size", "4"],
     {"train_micro_batch_size_per_gpu": 8, "zero_optimization.offload_optimizer.device": "cpu",
      "optimizer.params.weight_decay": 0.01}),
    ("bert-lamb", "ds.json", BERT_LAMB, ["--world-size", "64"],
     {"gradient_accumulation_steps": 1, "optimizer.type": "Lamb"}),
    ("legacy-cpu-offload-keys", "ds.json", LEGACY_OFFLOAD, ["--world-size", "8"],
     {"zero_optimization.offload_optimizer.device": "cpu", "zero_optimization.offload_optimizer.pin_memory": True,
      "gradient_clipping": 1.0, "optimizer.params.bias_correction": False}),
    ("gpt-random-ltd-eigenvalue", "ds.json", GPT_RANDOM_LTD, ["--world-size", "8"],
     {"gradient_accumulation_steps": 8, "data_efficiency.data_routing.random_ltd.random_ltd_layer_num": 22,
      "eigenvalue.layer_name": "transformer.h"}),
    ("gpt-data-efficiency-curriculum", "ds.json", GPT_DATA_CURRICULUM, ["--world-size", "16"],
     {"gradient_accumulation_steps": 4,
      "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics.seqlen_truncate.max_difficulty": 2048}),
    ("autotp-zero1-bf16", "ds.json", AUTOTP_ZERO1, ["--world-size", "8"],
     {"gradient_accumulation_steps": 4, "tensor_parallel.autotp_size": 4, "zero_optimization.stage": 1}),
    ("elasticity-documented-example", "ds.json", ELASTIC, ["--world-size", "8"],
     {"train_batch_size": 1680, "train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": 35}),
    ("boolean-zero-optimization", "ds.json", BOOLEAN_ZERO, ["--world-size", "2"],
     {"zero_optimization.stage": 0, "gradient_accumulation_steps": 1}),
    ("yaml-onecycle-sgd", "ds.yaml", YAML_ONECYCLE, [],
     {"optimizer.type": "SGD", "zero_optimization.reduce_bucket_size": 500_000_000, "bf16.enabled": False}),
]


@pytest.mark.parametrize(("name", "content", "args", "expected"), [r[1:] for r in REAL], ids=[r[0] for r in REAL])
def test_real_world_configs_parse_unchanged(tmp_path, name, content, args, expected) -> None:
    result = _validate(_write(tmp_path, name, content), *args, "--json")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    normalized = json.loads(result.stdout)
    for dotted, value in expected.items():
        node = normalized
        for part in dotted.split("."):
            node = node[part]
        assert node == value, dotted
    tbs = normalized["train_batch_size"]
    world = int(args[args.index("--world-size") + 1]) if "--world-size" in args else 1
    dp = world // max(1, normalized["tensor_parallel"]["autotp_size"])  # tensor-parallel ranks share a batch
    assert tbs == normalized["train_micro_batch_size_per_gpu"] * normalized["gradient_accumulation_steps"] * dp


def test_validate_runs_without_torch(tmp_path) -> None:
    path = _write(tmp_path, "ds.json", FP16_STAGE2_OFFLOAD)
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from deepfleet.controller.cli import app\n"
        f"app(['validate', {path!r}, '--world-size', '4', '--json'], standalone_mode=False)\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["train_micro_batch_size_per_gpu"] == 8


def test_pretty_output_by_default(tmp_path) -> None:
    result = _validate(_write(tmp_path, "ds.json", MEGATRON_BF16_STAGE1), "-w", "8")
    assert result.returncode == 0 and result.stdout.startswith('{\n  "train_batch_size": 256,')
    assert json.loads(result.stdout)["zero_optimization"]["stage"] == 1
