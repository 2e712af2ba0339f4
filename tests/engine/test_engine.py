"""The engine's public surface on one process (a one-rank gloo group): initialize's argument handling,
DeepSpeed's accessors and micro-step protocol, optimizer/scheduler sources, logging, the data loader's
resumable position, and stage-0/3 state dicts. Multi-rank behaviour is in test_zero_stages.py,
test_precision.py and test_deepspeed_port.py."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist

import deepfleet.engine as deepspeed
from deepfleet.engine.config import ConfigError
from deepfleet.engine.dataloader import ResumableDistributedSampler
from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)
BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}


pytestmark = pytest.mark.usefixtures("one_rank_group")


def model() -> GPTWithLoss:
    torch.manual_seed(0)
    return GPTWithLoss(TINY)


def data(n: int = 64) -> SyntheticTokens:
    return SyntheticTokens(num_samples=n, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)


def init(config: dict, **kw):
    m = kw.pop("model", None) or model()
    return deepspeed.initialize(model=m, config={**BASE, **config}, **kw)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"config": BASE}, "model: required"),
        ({"model": "M"}, "config: required"),
        ({"model": "M", "config": BASE, "mpu": object()}, "mpu:"),
        ({"model": "M", "config": BASE}, "optimizer: none configured"),
        ({"model": "M", "config": {**BASE, "optimizer": ADAMW}, "optimizer": lambda g: torch.optim.SGD(g, lr=0.1)},
         "optimizer: set in the config and passed"),
        ({"model": "M", "config": {**BASE, "optimizer": ADAMW, "zero_optimization": {"stage": 7}}},
         "zero_optimization.stage"),
        ({"model": "M", "config": {**BASE, "optimizer": ADAMW}, "model_parameters": [torch.zeros(2, requires_grad=True)]},
         "model_parameters[0]"),
    ],
)
def test_bad_arguments_fail_with_the_field_named(kwargs: dict, message: str) -> None:
    if kwargs.get("model") == "M":
        kwargs["model"] = model()
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        deepspeed.initialize(**kwargs)


def test_config_errors_come_from_the_config_loader() -> None:
    with pytest.raises(ConfigError, match="not_a_key"):
        init({"optimizer": ADAMW, "not_a_key": 1})


def test_micro_step_protocol_and_accessors() -> None:
    engine, optimizer, loader, scheduler = init(
        {"optimizer": ADAMW, "gradient_clipping": 1.0,
         "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                       "warmup_num_steps": 4, "warmup_type": "linear"}}},
        training_data=data(),
    )
    assert engine.module is not None and isinstance(engine.module, GPTWithLoss)
    assert optimizer is engine.optimizer and scheduler is engine.lr_scheduler
    assert engine.train_micro_batch_size_per_gpu() == 2 and engine.gradient_accumulation_steps() == 2
    assert engine.get_global_grad_norm() is None
    boundaries, lrs = [], []
    for batch in list(loader)[:6]:
        assert batch["input_ids"].shape == (2, TINY.seq_len)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(batch))
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert boundaries == [False, True] * 3
    assert (engine.micro_steps, engine.global_steps, engine.global_samples) == (6, 3, 12)
    assert lrs[1] < lrs[3] < lrs[5]  # warmup advances once per optimizer step
    norm = engine.get_global_grad_norm()
    assert norm is not None and norm > 0 and torch.isfinite(torch.tensor(norm))


def test_clipping_bounds_the_gradient_norm() -> None:
    engine, *_ = init({"optimizer": ADAMW, "gradient_accumulation_steps": 1})
    batch = data()[0]
    batch = {k: v.unsqueeze(0) for k, v in batch.items()}
    engine.backward(engine(batch))
    engine.sharding.finish_gradients(grad_scale=1.0)
    before = engine.sharding.clip_grad_norm_(0.0)  # 0 = measure only
    after = engine.sharding.clip_grad_norm_(before / 10)
    assert after == pytest.approx(before)  # returns the pre-clip norm
    assert engine.sharding.clip_grad_norm_(0.0) == pytest.approx(before / 10, rel=1e-4)


def test_a_user_optimizer_and_scheduler_are_kept_and_regrouped() -> None:
    m = model()
    decay = [p for n, p in m.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in m.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=m, config={**BASE, "gradient_accumulation_steps": 1, "bf16": {"enabled": True}},
        optimizer=opt, lr_scheduler=sched,
    )
    assert optimizer is opt and scheduler is sched
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    # bf16 at stage 0: the optimizer now updates fp32 masters, not the bf16 parameters
    assert all(p.dtype == torch.float32 for g in opt.param_groups for p in g["params"])
    assert next(m.parameters()).dtype == torch.bfloat16
    batch = {k: v.unsqueeze(0) for k, v in data()[0].items()}
    before = [p.detach().clone() for p in m.parameters()]
    engine.backward(engine(batch))
    engine.step()
    assert engine.get_lr() == [5e-3, 5e-3]
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, m.parameters(), strict=True))


def test_steps_per_print_logs_loss_lr_norm_and_throughput(caplog: pytest.LogCaptureFixture) -> None:
    engine, _, loader, _ = init({"optimizer": ADAMW, "steps_per_print": 2, "wall_clock_breakdown": True},
                                training_data=data())
    with caplog.at_level(logging.INFO, logger="deepfleet.engine.progress"):
        for batch in list(loader)[:8]:  # 4 optimizer steps -> 2 reports
            engine.backward(engine(batch))
            engine.step()
    lines = [r.getMessage() for r in caplog.records if r.name == "deepfleet.engine.progress"]
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(" |")[0] for line in steps] == ["step 2", "step 4"]
    for key in ("loss", "lr", "grad_norm", "loss_scale", "samples/s"):
        assert key in steps[0]
    assert sum("forward" in line and "backward" in line for line in lines) == 2


def test_data_loader_position_resumes_at_any_world_size() -> None:
    engine, _, loader, _ = init({"optimizer": ADAMW, "seed": 3}, training_data=data(40))
    assert isinstance(loader.sampler, torch.utils.data.DistributedSampler)
    assert loader.batch_size == 2 and loader.sampler.seed == 3
    epoch0 = [b["input_ids"] for b in loader]
    assert len(epoch0) == 20 and loader.epoch == 1
    it = iter(loader)
    first = [next(it)["input_ids"] for _ in range(3)]
    state = loader.state_dict()
    assert state == {"epoch": 1, "samples_consumed": 6, "seed": 3}
    rest = [b["input_ids"] for b in it]
    assert not all(torch.equal(a, b) for a, b in zip(first, epoch0[:3], strict=True))  # reshuffled per epoch
    _, _, again, _ = init({"optimizer": ADAMW, "seed": 3}, training_data=data(40))
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip([b["input_ids"] for b in again], rest, strict=True))
    # world-size independence: two ranks after 6 global samples deal out exactly what one rank has left
    ds = data(40)
    one = ResumableDistributedSampler(ds, num_replicas=1, rank=0, seed=3)
    one.set_epoch(1)
    one.start = 6
    two = []
    for rank in range(2):
        s = ResumableDistributedSampler(ds, num_replicas=2, rank=rank, seed=3)
        s.set_epoch(1)
        s.start = 6
        two.append(list(s))
    dealt = [i for pair in zip(*two, strict=True) for i in pair]
    assert dealt == list(one) and len(two[0]) == len(two[1]) == 17
    with pytest.raises(ValueError, match="seed"):
        again.load_state_dict({**state, "seed": 4})


@pytest.mark.parametrize(("stage", "bf16"), [(0, False), (0, True), (3, False)])
def test_state_dict_round_trip_uses_original_fqns(stage: int, bf16: bool) -> None:
    m = model()
    names = {n for n, _ in m.named_parameters()}
    engine, _, loader, _ = init({"optimizer": ADAMW, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}},
                                model=m, training_data=data())
    batches = list(loader)
    for batch in batches[:2]:
        engine.backward(engine(batch))
        engine.step()
    state = engine.sharding.state_dict()
    assert set(state["model"]) == names
    assert set(state["optim"]["state"]) == names
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(state["optim"]["state"][sorted(names)[0]])
    assert all(v.dtype == torch.float32 for v in state["model"].values())  # fp32 masters are saved
    saved = {k: v.detach().clone() for k, v in state["model"].items()}
    saved_avg = {k: v["exp_avg"].detach().clone() for k, v in state["optim"]["state"].items()}
    for batch in batches[2:4]:
        engine.backward(engine(batch))
        engine.step()
    moved = engine.sharding.state_dict()
    assert any(not torch.equal(saved[k], moved["model"][k]) for k in names)
    engine.sharding.load_state_dict({"model": saved, "optim": {
        "state": {k: {**v, "exp_avg": saved_avg[k]} for k, v in moved["optim"]["state"].items()},
        "param_groups": moved["optim"]["param_groups"]}})
    restored = engine.sharding.state_dict()
    for k in names:
        assert torch.equal(restored["model"][k], saved[k]), k
        assert torch.equal(restored["optim"]["state"][k]["exp_avg"], saved_avg[k]), k
    if stage == 0:  # the 16-bit copy the model runs on follows the masters
        for n, p in m.named_parameters():
            assert torch.equal(p.detach(), saved[n].to(p.dtype)), n


def test_init_distributed_is_a_no_op_alone_and_names_missing_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime

    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    deepspeed.init_distributed()
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK, MASTER_ADDR, MASTER_PORT not set"):
        deepspeed.init_distributed()
    with pytest.raises(ValueError, match="rank: required"):
        deepspeed.init_distributed(world_size=1)
    # bound first on port 0 and kept: torch's tcp:// rendezvous opens it as a multi-tenant server
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    deepspeed.init_distributed("gloo", init_method=f"tcp://127.0.0.1:{server.port}", rank=0, world_size=1)
    assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    deepspeed.init_distributed()  # already initialized: no-op


def test_the_group_the_engine_made_is_destroyed_at_exit(tmp_path) -> None:
    """A gloo group alive into interpreter finalization can abort a finished script (exit -6); the
    engine destroys the group it made before that, and leaves alone a group the script destroyed."""
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(
        "import atexit, sys, torch, torch.distributed as dist\n"
        "import deepfleet.engine as deepspeed\n"
        # registered first, so it runs after the engine's own exit hook
        "atexit.register(lambda: print('at exit initialized:', dist.is_initialized()))\n"
        "engine, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 1), config={\n"
        "    'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-3}},\n"
        "    'zero_optimization': {'stage': int(sys.argv[1])}})\n"
        "engine.backward(engine(torch.ones(2, 4)).sum()); engine.step()\n"
        "if sys.argv[2] == 'destroy':\n"
        "    dist.destroy_process_group()\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")}
    for stage, how in ((0, "leave"), (1, "leave"), (1, "destroy")):
        proc = subprocess.run([sys.executable, str(script), str(stage), how], capture_output=True, text=True,
                              timeout=120, env={**env, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "at exit initialized: False" in proc.stdout, (stage, how, proc.stdout)


def test_backward_options() -> None:
    engine, *_ = init({"optimizer": ADAMW, "gradient_accumulation_steps": 2})
    batch = {k: v.unsqueeze(0) for k, v in data()[0].items()}
    engine.backward(engine(batch))
    grads = [p.grad.clone() for p in engine.module.parameters()]
    engine.zero_grad()
    loss = engine(batch)
    engine.backward(loss, retain_graph=True, scale_wrt_gas=False)  # not divided by the 2 micro-steps
    for g, p in zip(grads, engine.module.parameters(), strict=True):
        torch.testing.assert_close(p.grad, 2 * g)


@pytest.mark.parametrize(("stage", "bf16"), [(0, False), (0, True), (3, False)])
def test_checkpoint_resumes_a_fresh_engine(tmp_path, stage: int, bf16: bool) -> None:
    """save_checkpoint/load_checkpoint delegate to deepfleet.engine.checkpoint; a fresh engine (other
    init, no optimizer state yet) continues exactly like the one that saved."""
    cfg = {"optimizer": ADAMW, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 10}}}
    engine, _, loader, _ = init(cfg, training_data=data())
    batches = list(loader)
    for batch in batches[:4]:
        engine.backward(engine(batch))
        engine.step()
    engine.save_checkpoint(tmp_path, client_state={"note": "hi"})
    torch.manual_seed(5)
    fresh, _, fresh_loader, _ = init(cfg, model=GPTWithLoss(TINY), training_data=data())
    path, client = fresh.load_checkpoint(tmp_path)
    assert path is not None and client == {"note": "hi"}
    assert (fresh.global_steps, fresh.micro_steps, fresh.get_lr()) == (engine.global_steps, engine.micro_steps, engine.get_lr())
    assert fresh_loader.state_dict() == loader.state_dict()
    for batch in batches[4:6]:
        for e in (engine, fresh):
            e.backward(e(batch))
            e.step()
    a, b = engine.sharding.state_dict(), fresh.sharding.state_dict()
    for name, value in a["model"].items():
        torch.testing.assert_close(b["model"][name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(b["optim"]["state"][name]["exp_avg_sq"], a["optim"]["state"][name]["exp_avg_sq"],
                                   rtol=0, atol=0)
