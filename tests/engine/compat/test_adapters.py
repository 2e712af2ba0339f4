"""DeepSpeed's names at DeepSpeed's paths under `deepfleet.engine`, each called the way real scripts call it
(one process; the multi-rank ones are in test_zero_adapters.py, whole scripts in test_scripts.py)."""

from __future__ import annotations

import argparse
import json
import logging
import math

import pytest
import torch
import torch.distributed as dist

import deepfleet.engine as deepspeed
from deepfleet.engine.config import ConfigError, load_config
from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}}


pytestmark = pytest.mark.usefixtures("one_rank_group")


def gpt() -> GPTWithLoss:
    torch.manual_seed(0)
    return GPTWithLoss(TINY)


# --- accelerator ------------------------------------------------------------------------------------


def test_accelerator_as_scripts_use_it() -> None:
    from deepfleet.engine.accelerator import get_accelerator

    acc = get_accelerator()
    assert acc is get_accelerator()
    assert acc.device_name() == acc.device_name(1) == acc.current_device_name() == "cpu"
    assert acc.communication_backend_name() == "gloo"
    assert acc.device_count() >= 1 and acc.is_available() and acc.is_bf16_supported()
    assert not acc.is_fp16_supported()  # as DeepSpeed's CPU accelerator on this kind of machine
    x = torch.ones(3).to(acc.current_device_name())
    assert acc.on_accelerator(x)
    acc.manual_seed(7)
    a = torch.rand(2)
    acc.manual_seed_all(7)
    assert torch.equal(a, torch.rand(2))
    acc.synchronize()
    acc.empty_cache()
    assert 0 < acc.memory_allocated() <= acc.max_memory_allocated() < acc.total_memory()
    assert 0 < acc.available_memory() <= acc.total_memory()
    assert acc.FloatTensor(2, 3).shape == (2, 3) and acc.LongTensor([1, 2]).dtype == torch.int64
    assert torch.float32 in acc.supported_dtypes()


def test_accelerator_override_is_checked(monkeypatch) -> None:
    from deepfleet.engine.compat import accelerator

    monkeypatch.setattr(accelerator, "_ACCELERATOR", [])
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR: 'xpu' is not supported"):
        accelerator.get_accelerator()


# --- optimizers -------------------------------------------------------------------------------------


def _run(opt_factory, steps: int = 4) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    opt = opt_factory(params)
    for i in range(steps):
        for p in params:
            p.grad = torch.sin(p.detach() * (i + 1))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in params]


def _naive_adam(*, lr, b1, b2, eps, wd, bias_correction, adamw, steps=4):
    torch.manual_seed(0)
    ws = [torch.randn(5, 3).double(), torch.randn(4).double()]
    m = [torch.zeros_like(w) for w in ws]
    v = [torch.zeros_like(w) for w in ws]
    for t in range(1, steps + 1):
        for i, w in enumerate(ws):
            g = torch.sin(w.float() * t).double()
            if not adamw:
                g = g + wd * w
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            c1 = 1 - b1**t if bias_correction else 1.0
            c2 = 1 - b2**t if bias_correction else 1.0
            if adamw:
                w.mul_(1 - lr * wd)
            w.sub_(lr / c1 * m[i] / (v[i].sqrt() / math.sqrt(c2) + eps))
    return [w.float() for w in ws]


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_matches_the_formula(bias_correction: bool, adam_w_mode: bool) -> None:
    from deepfleet.engine.ops.adam import FusedAdam

    got = _run(lambda p: FusedAdam(p, lr=0.01, bias_correction=bias_correction, betas=(0.9, 0.99), eps=1e-6,
                                   adam_w_mode=adam_w_mode, weight_decay=0.1))
    want = _naive_adam(lr=0.01, b1=0.9, b2=0.99, eps=1e-6, wd=0.1, bias_correction=bias_correction, adamw=adam_w_mode)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_cpu_adam_lamb_lion_signatures() -> None:
    from deepfleet.engine.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepfleet.engine.ops.lamb import FusedLamb
    from deepfleet.engine.ops.lion import FusedLion
    from deepfleet.engine.optim import Lamb, Lion

    cpu = _run(lambda p: DeepSpeedCPUAdam(p, lr=0.01, weight_decay=0.01, adamw_mode=True))
    ref = _run(lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.01))
    for a, b in zip(cpu, ref, strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(_run(lambda p: FusedLamb(p, lr=0.01, weight_decay=0.01)),
                    _run(lambda p: Lamb(p, lr=0.01, weight_decay=0.01)), strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(_run(lambda p: FusedLion(p, lr=0.01)), _run(lambda p: Lion(p, lr=0.01)), strict=True):
        torch.testing.assert_close(a, b)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([torch.nn.Parameter(torch.ones(1))], amsgrad=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        FusedLamb([torch.nn.Parameter(torch.ones(1))], max_grad_norm=1.0)
    p = torch.nn.Parameter(torch.ones(2))
    opt = FusedAdam([p])
    p.grad = torch.ones(2)
    opt.zero_grad()
    assert p.grad is None  # set_grad_none=True


def test_bias_correction_false_in_the_config() -> None:
    cfg = {**CONFIG, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": False}}}
    engine, opt, *_ = deepspeed.initialize(model=gpt(), config=cfg)
    assert type(opt).__name__ == "Adam" and opt.param_groups[0]["bias_correction"] is False
    from deepfleet.engine.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="bias_correction: false with amsgrad"):
        load_config({**cfg, "optimizer": {"type": "Adam", "params": {"bias_correction": False, "amsgrad": True}}})


# --- utils, runtime ---------------------------------------------------------------------------------


def test_logger_and_log_dist(capsys) -> None:
    from deepfleet.engine.utils import log_dist, logger

    logger.info("plain message")
    log_dist("before any group", ranks=[0])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    log_dist("rank zero", ranks=[0])
    log_dist("everyone", ranks=[-1])
    log_dist("nobody", ranks=None)
    log_dist("someone else", ranks=[1], level=logging.WARNING)
    out = capsys.readouterr().out
    assert "plain message" in out and "[Rank -1] before any group" in out
    assert "[Rank 0] rank zero" in out and "[Rank 0] everyone" in out
    assert "nobody" not in out and "someone else" not in out


def test_repeating_loader_restarts_with_a_new_epoch() -> None:
    from deepfleet.engine.runtime.dataloader import RepeatingLoader as Same
    from deepfleet.engine.utils import RepeatingLoader

    assert Same is RepeatingLoader
    sampler = torch.utils.data.DistributedSampler(list(range(4)), num_replicas=1, rank=0, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(list(range(4)), batch_size=2, sampler=sampler)
    it = RepeatingLoader(loader)
    first = [next(it).tolist() for _ in range(2)]
    second = [next(it).tolist() for _ in range(2)]
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == [0, 1, 2, 3]
    assert it.epoch == 1 and sampler.epoch == 1 and first != second and len(it) == 2


def test_runtime_utils() -> None:
    from deepfleet.engine.checkpoint.utils import clone_tensors_for_torch_save
    from deepfleet.engine.runtime.lr_schedules import VALID_LR_SCHEDULES, WarmupLR
    from deepfleet.engine.runtime.utils import move_to_device, see_memory_usage, set_random_seed

    set_random_seed(11)
    a = torch.rand(3)
    set_random_seed(11)
    assert torch.equal(a, torch.rand(3))
    batch = {"x": [torch.ones(2), (torch.zeros(1), 3)], "y": "text"}
    moved = move_to_device(batch, "cpu")
    assert moved["y"] == "text" and isinstance(moved["x"][1], tuple) and moved["x"][1][1] == 3
    see_memory_usage("not printed")  # force=False: nothing to do
    see_memory_usage("printed", force=True)
    big = torch.arange(100.0)
    saved = clone_tensors_for_torch_save({"view": big[:3], "n": 1})
    assert saved["view"].untyped_storage().nbytes() == 12 and saved["n"] == 1
    assert set(VALID_LR_SCHEDULES) == {"LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}
    assert WarmupLR.__module__ == "deepfleet.engine.lr_schedules"


def test_add_config_arguments_and_initialize_args(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(CONFIG))
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path), "--local_rank=0"])
    assert args.deepspeed and args.deepspeed_config == str(path)
    engine, *_ = deepspeed.initialize(args=args, model=gpt(), model_parameters=None)
    assert engine.gradient_accumulation_steps() == 2
    with pytest.raises(ValueError, match="config: given both"):
        deepspeed.initialize(args=args, model=gpt(), config=CONFIG)
    legacy = argparse.Namespace(deepscale_config=str(path))
    engine, *_ = deepspeed.initialize(args=legacy, model=gpt())
    assert engine.train_micro_batch_size_per_gpu() == 2


def test_deepspeed_config_and_version() -> None:
    cfg = deepspeed.DeepSpeedConfig({**CONFIG, "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
                                     "gradient_clipping": 1.0})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (4, 2, 2)
    assert cfg.zero_enabled and cfg.zero_optimization_stage == 2 and cfg.bfloat16_enabled and not cfg.fp16_enabled
    assert cfg.optimizer_name == "adamw" and cfg.optimizer_params["lr"] == 1e-3 and cfg.gradient_clipping == 1.0
    from deepfleet.engine.runtime.config import DeepSpeedConfig

    assert DeepSpeedConfig is type(cfg)
    from importlib import metadata

    assert deepspeed.__version__ == metadata.version("deepfleet")
    assert deepspeed.__deepspeed_compat_version__.startswith("0.")


# --- the engine's members ---------------------------------------------------------------------------


def test_engine_members_as_scripts_read_them(tmp_path) -> None:
    cfg = {**CONFIG, "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}}
    model = gpt()
    model.custom_attribute = "on the model"
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    assert isinstance(engine, deepspeed.DeepSpeedEngine)
    assert (engine.local_rank, engine.global_rank, engine.world_size) == (0, 0, 1)
    assert engine.device == torch.device("cpu")
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled() and engine.zero_optimization_stage() == 0
    assert engine.custom_attribute == "on the model"  # falls through to the wrapped model
    child_name, child = next(iter(model.named_children()))
    assert getattr(engine, child_name) is child
    with pytest.raises(AttributeError):
        _ = engine.no_such_attribute
    data = SyntheticTokens(num_samples=8, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
    batch = {k: torch.stack([data[i][k] for i in range(2)]) for k in data[0]}
    applied = []
    for _ in range(4):
        engine.backward(engine(batch))
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [False, True, False, True]
    assert engine.tput_timer.avg_samples_per_sec() > 0
    engine.set_gradient_accumulation_boundary(True)  # every micro-step is a boundary now
    engine.backward(engine(batch))
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 3
    assert engine.monitor.enabled
    engine.monitor.write_events([("Train/custom_metric", 1.5, 42)])
    engine.destroy()
    text = (tmp_path / "run" / "Train_custom_metric.csv").read_text().splitlines()
    assert text == ["step,custom_metric", "42,1.5"]


def test_load_checkpoint_not_strict(tmp_path) -> None:
    engine, *_ = deepspeed.initialize(model=gpt(), config=CONFIG)
    engine.save_checkpoint(tmp_path)

    class Bigger(GPTWithLoss):
        def __init__(self) -> None:
            super().__init__(TINY)
            self.extra_head = torch.nn.Linear(4, 4)

    torch.manual_seed(5)
    bigger = Bigger()
    extra = bigger.extra_head.weight.detach().clone()
    engine2, *_ = deepspeed.initialize(model=bigger, config=CONFIG)
    from deepfleet.engine.checkpoint.layout import CheckpointError

    with pytest.raises(CheckpointError, match="extra_head"):
        engine2.load_checkpoint(tmp_path)
    path, _ = engine2.load_checkpoint(tmp_path, load_module_strict=False)
    assert path is not None
    assert torch.equal(bigger.extra_head.weight, extra)  # kept: not in the checkpoint
    for name, p in engine.module.named_parameters():
        assert torch.equal(p, dict(bigger.named_parameters())[name]), name


def test_zero_to_fp32(tmp_path) -> None:
    from deepfleet.engine.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    engine, *_ = deepspeed.initialize(model=gpt(), config={**CONFIG, "bf16": {"enabled": True}})
    engine.save_checkpoint(tmp_path, tag="t1")
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert set(state) == set(engine.module.state_dict())
    assert all(t.dtype == torch.float32 for t in state.values() if t.is_floating_point())
    out = convert_zero_checkpoint_to_fp32_state_dict(tmp_path, tmp_path / "fp32", safe_serialization=True)
    from safetensors.torch import load_file

    assert set(load_file(str(out))) == set(state)
    fresh = load_state_dict_from_zero_checkpoint(GPTWithLoss(TINY), tmp_path, tag="t1")
    for name, p in fresh.state_dict().items():  # fp32 masters; the module holds their bf16 rounding
        torch.testing.assert_close(p.to(torch.bfloat16), engine.module.state_dict()[name].to(torch.bfloat16))
    from deepfleet.engine.checkpoint.layout import CheckpointError

    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "empty")


def test_groups_answer_for_the_engine() -> None:
    from deepfleet.engine.utils import groups

    engine, *_ = deepspeed.initialize(model=gpt(), config=CONFIG)
    assert groups._get_data_parallel_world_size() == 1 and groups._get_data_parallel_rank() == 0
    assert groups._get_expert_parallel_world_size("ep_size_1") == 1
    assert groups._get_sequence_parallel_world_size() == 1 and groups.get_tensor_model_parallel_world_size() == 1
    assert groups._get_broadcast_src_rank() == 0


def test_z3_leaf_modules_become_stage3_units() -> None:
    from deepfleet.engine.blocks import blocks, shard_units
    from deepfleet.engine.utils import (
        get_z3_leaf_modules,
        set_z3_leaf_modules,
        unset_z3_leaf_modules,
        z3_leaf_module,
    )

    class Pair(torch.nn.Module):
        def __init__(self, blocks) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(blocks)

    model = gpt()
    found = blocks(model)
    assert shard_units(model) == found
    wrapper = torch.nn.Module()
    wrapper.inner = Pair(list(found))
    marked = set_z3_leaf_modules(wrapper, [Pair])
    assert marked == [wrapper.inner] and z3_leaf_module(wrapper.inner) and get_z3_leaf_modules(wrapper) == marked
    assert shard_units(wrapper) == [wrapper.inner]  # the leaf holds the blocks: it is gathered whole
    unset_z3_leaf_modules(wrapper, ["Pair"])
    assert shard_units(wrapper) == found
    with pytest.raises(ValueError, match="leaf_module_classes: no submodule"):
        set_z3_leaf_modules(model, [torch.nn.Conv2d])


def test_zero_names() -> None:
    from deepfleet.engine.runtime.zero.partition_parameters import ZeroParamStatus

    assert deepspeed.zero.ZeroParamStatus is ZeroParamStatus and ZeroParamStatus.NOT_AVAILABLE.value == 2
    with deepspeed.zero.Init(config_dict_or_path=CONFIG, dtype=torch.bfloat16):
        layer = torch.nn.Linear(3, 3)
    assert layer.weight.dtype == torch.bfloat16
    with deepspeed.zero.Init(enabled=False, dtype=torch.bfloat16):
        assert torch.nn.Linear(3, 3).weight.dtype == torch.float32
    with pytest.raises(ValueError, match="remote_device: 'nvme'"):
        deepspeed.zero.Init(remote_device="nvme")
    p = torch.nn.Parameter(torch.ones(2))
    with deepspeed.zero.GatheredParameters(p, modifier_rank=0):  # no process group: nothing to gather
        p.data.mul_(3)
    assert torch.equal(p.detach(), torch.full((2,), 3.0))


def test_timers_section_switches_the_throughput_timer() -> None:
    cfg = {**CONFIG, "timers": {"throughput": {"enabled": False, "synchronized": False}}}
    engine, *_ = deepspeed.initialize(model=gpt(), config=cfg)
    data = SyntheticTokens(num_samples=8, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
    batch = {k: torch.stack([data[i][k] for i in range(2)]) for k in data[0]}
    for _ in range(4):
        engine.backward(engine(batch))
        engine.step()
    assert engine.global_steps == 2 and engine.tput_timer.avg_samples_per_sec() == 0.0
    with pytest.raises(ConfigError, match="timers.throughput.enable: unknown key; did you mean"):
        load_config({**CONFIG, "timers": {"throughput": {"enable": True}}})
