"""fp16 loss scaling with DeepSpeed's semantics: the scaler as a table of overflow sequences, and a real
2-rank fp16 run where an inf injected into one rank's gradient skips the step everywhere."""

from __future__ import annotations

import math

import pytest
import torch

from deepfleet.engine.precision import DynamicLossScaler, Precision, StaticLossScaler, build_precision
from tests.spawn import spawn

OV, OK = True, False  # overflow, good step


def scales(seq: list[bool], **kw) -> list[float]:
    params = {"scale": 2.0**8, "window": 2, "hysteresis": 1, "consecutive_hysteresis": False, "min_scale": 1.0}
    scaler = DynamicLossScaler(**{**params, **kw})
    out = []
    for overflow in seq:
        scaler.update(overflow)
        out.append(scaler.scale)
    return out


@pytest.mark.parametrize(
    ("seq", "kw", "expected"),
    [
        # no hysteresis: every overflow halves; `window` good steps since the last overflow double
        ([OV, OK, OK, OK, OK], {}, [128, 128, 256, 256, 512]),
        # hysteresis 2: the first overflow only spends hysteresis, the second halves
        ([OV, OV, OV], {"hysteresis": 2}, [256, 128, 64]),
        # a doubling refills the hysteresis budget (not consecutive): an overflow after it is absorbed
        ([OV, OV, OK, OK, OV], {"hysteresis": 2}, [256, 128, 128, 256, 256]),
        # without a doubling in between, the budget stays spent: the next overflow halves
        ([OV, OK, OV], {"hysteresis": 2, "window": 10}, [256, 256, 128]),
        # consecutive hysteresis: any good step refills the budget
        ([OV, OK, OV], {"hysteresis": 2, "window": 10, "consecutive_hysteresis": True}, [256, 256, 256]),
        # the scale never goes below min_loss_scale
        ([OV, OV, OV], {"scale": 4.0, "min_scale": 2.0}, [2, 2, 2]),
        # from the start, the first doubling comes after `window` good steps
        ([OK, OK, OK, OK], {"window": 3}, [256, 256, 512, 512]),
    ],
)
def test_dynamic_scaler_follows_deepspeed_semantics(seq, kw, expected) -> None:
    assert scales(seq, **kw) == expected


def test_scaler_state_round_trips() -> None:
    a = DynamicLossScaler(scale=64.0, window=3, hysteresis=2, consecutive_hysteresis=False, min_scale=1.0)
    for overflow in (OV, OK, OV):
        a.update(overflow)
    b = DynamicLossScaler(scale=1.0, window=3, hysteresis=2, consecutive_hysteresis=False, min_scale=1.0)
    b.load_state_dict(a.state_dict())
    for overflow in (OK, OK, OV, OK):
        a.update(overflow)
        b.update(overflow)
        assert (a.scale, a.hysteresis_left) == (b.scale, b.hysteresis_left)


def _config(fp16: dict | None = None, bf16: bool = False):
    from deepfleet.engine.config import load_config

    return load_config({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": False, **(fp16 or {})},
                        "bf16": {"enabled": bf16}})


def test_policies_from_config() -> None:
    fp32, bf16 = build_precision(_config()), build_precision(_config(bf16=True))
    assert (fp32.compute_dtype, fp32.loss_scale, fp32.update(True)) == (torch.float32, 1.0, True)
    assert (bf16.compute_dtype, bf16.loss_scale, bf16.update(True)) == (torch.bfloat16, 1.0, True)
    dynamic = build_precision(_config({"enabled": True, "initial_scale_power": 5}))
    assert dynamic.compute_dtype == torch.float16 and dynamic.loss_scale == 32.0
    static = build_precision(_config({"enabled": True, "loss_scale": 128.0}))
    assert isinstance(static.scaler, StaticLossScaler)
    assert static.update(True) is False and static.loss_scale == 128.0  # skipped, scale unchanged
    assert static.update(False) is True
    loss = torch.tensor(0.5)
    assert float(static.scale_loss(loss)) == 64.0


def test_overflow_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    policy = Precision(torch.float16, scaler=StaticLossScaler(8.0), skip_on_overflow=True)
    with caplog.at_level("WARNING", logger="deepfleet.engine.precision"):
        assert policy.update(True) is False
    assert "overflow" in caplog.text and "skipped" in caplog.text


def _fp16_run(rank: int, world_size: int, stage: int) -> dict:
    import deepfleet.engine as deepspeed
    from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2},
    }
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=model, config=config, training_data=SyntheticTokens(num_samples=64, seq_len=16, vocab_size=64),
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
    )
    target = next(p for p in model.parameters() if p.dim() == 2)
    plan = [OV, OV, OK, OK, OV, OK]
    trace = []
    for overflow, batch in zip(plan, loader, strict=False):
        before = [p.detach().clone() for p in model.parameters()]
        loss = engine(batch)
        engine.backward(loss)
        if overflow and rank == world_size - 1:
            # one element of the last rank's (local shard of the) reduced gradient: only this rank
            # sees the inf, so the others must learn of it from the strategy's agreement
            grad = target.grad.to_local() if hasattr(target.grad, "to_local") else target.grad
            grad.view(-1)[0] = math.inf
        engine.step()
        changed = any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True))
        trace.append({
            "scale": engine.loss_scale, "changed": changed, "global_steps": engine.global_steps,
            "skipped": engine.skipped_steps, "lr_steps": scheduler.last_epoch,
            "dtype": str(next(model.parameters()).dtype),
        })
    return {"trace": trace}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_overflow_skips_the_step_on_every_rank_and_adapts_the_scale(stage: int) -> None:
    """initial scale 2**8, hysteresis 2, window 2. Step 1 overflows (scale kept, hysteresis spent),
    step 2 overflows (halved to 128), steps 3-4 are good (doubled to 256 after 2, refilling the
    hysteresis), step 5 overflows (absorbed by hysteresis: stays 256), step 6 good."""
    for rank, result in enumerate(spawn(_fp16_run, 2, stage, timeout=180)):
        trace = result["trace"]
        assert [t["scale"] for t in trace] == [256, 128, 128, 256, 256, 256], rank
        assert [t["changed"] for t in trace] == [False, False, True, True, False, True], rank
        # DeepSpeed counts skipped steps in global_steps; the LR schedule advances only on real steps
        assert [t["global_steps"] for t in trace] == [1, 2, 3, 4, 5, 6]
        assert [t["skipped"] for t in trace] == [1, 2, 2, 2, 3, 3]
        assert [t["lr_steps"] for t in trace] == [0, 0, 1, 2, 2, 3]
        assert trace[0]["dtype"] == ("torch.float16" if stage == 0 else "torch.float32")  # FSDP: fp32 shards


def test_auto_cast_casts_only_floating_inputs() -> None:
    policy = build_precision(_config({"enabled": True, "auto_cast": True}))
    args, kwargs = policy.prepare_inputs(
        ({"x": torch.ones(2), "ids": torch.arange(3)}, [torch.zeros(1, dtype=torch.float64)]), {"y": torch.ones(1)}
    )
    assert args[0]["x"].dtype == torch.float16 and args[0]["ids"].dtype == torch.int64
    assert args[1][0].dtype == torch.float16 and kwargs["y"].dtype == torch.float16
    plain = build_precision(_config({"enabled": True}))
    x = torch.ones(2)
    assert plain.prepare_inputs((x,), {})[0][0] is x
