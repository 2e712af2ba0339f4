"""The step seam: every optimizer step reaches the engine's sinks as one StepMetrics with exact values
(2 gloo ranks, fp16 with an injected overflow, gradient accumulation 2: loss, lr, grad norm, loss scale,
skipped steps, samples, tokens, timings, comm bytes from the comm counters and the HighWater peak), sinks named by
DEEPFLEET_STEP_SINKS are built at initialize, and token counting."""

from __future__ import annotations

import math

import pytest
import torch

from deepfleet.engine.metrics import SINKS_ENV, StepMetrics, count_tokens, sinks_from_env
from tests.spawn import spawn

GAS, MICRO, SEQ = 2, 2, 16
ENV_SEEN: list[StepMetrics] = []


def env_sink():
    """A DEEPFLEET_STEP_SINKS factory (this module's list receives the records)."""
    return ENV_SEEN.append


def opt_out():
    return None


def not_a_sink():
    return 3


def _comm_bytes() -> int:
    from deepfleet.engine import comm

    return sum(c.bytes for c in comm.counters().values())


def _run(rank: int, world_size: int) -> dict:
    import deepfleet.engine as deepspeed
    from deepfleet.engine import comm
    from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(vocab_size=64, seq_len=SEQ, d_model=32, n_heads=2, n_layers=1))
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 4}},
    }
    engine, _, loader, _ = deepspeed.initialize(
        model=model, config=config, training_data=SyntheticTokens(num_samples=64, seq_len=SEQ, vocab_size=64)
    )
    seen: list[StepMetrics] = []
    engine.sinks.append(seen.append)
    target = next(p for p in model.parameters() if p.dim() == 2)
    expected, losses, comm_start = [], [], _comm_bytes()
    for i, batch in enumerate(loader):
        if i == 3 * GAS:
            break
        loss = engine(batch)
        engine.backward(loss)
        losses.append(float(loss.detach()))
        comm.all_reduce(torch.ones(25))  # a script's own collective inside the window (100 bytes)
        if i == 2 * GAS - 1 and rank == 1:  # step 2 overflows on rank 1 only
            target.grad.view(-1)[0] = math.inf
        before = engine.global_steps
        engine.step()
        if engine.global_steps > before:  # this micro-step ended a window
            comm_now = _comm_bytes()
            expected.append({
                "loss": sum(losses) / len(losses), "lr": engine.get_lr()[0], "grad_norm": engine.get_global_grad_norm(),
                "loss_scale": engine.loss_scale, "skipped_steps": engine.skipped_steps,
                "comm_bytes": comm_now - comm_start, "peak": engine.peak_model_state_bytes,
            })
            losses, comm_start = [], comm_now
    return {"seen": seen, "expected": expected}


@pytest.mark.slow
def test_step_metrics_reach_a_sink_with_exact_values() -> None:
    for rank, result in enumerate(spawn(_run, 2, timeout=180)):
        seen, expected = result["seen"], result["expected"]
        assert [m.step for m in seen] == [1, 2, 3]
        assert [m.skipped for m in seen] == [False, True, False]
        assert [m.rank for m in seen] == [rank] * 3
        for m, want in zip(seen, expected, strict=True):
            assert m.loss == pytest.approx(want["loss"], rel=1e-6)  # mean of this rank's micro losses
            assert m.lr == want["lr"] and m.lrs == (want["lr"],)
            assert m.grad_norm == want["grad_norm"]  # the engine's get_global_grad_norm()
            assert m.loss_scale == want["loss_scale"]
            assert m.skipped_steps == want["skipped_steps"]
            assert m.samples == MICRO * GAS * 2
            assert m.tokens == MICRO * GAS * SEQ * 2
            # the counters' difference over the step: the script's 2 x 100 bytes, plus whatever the
            # engine's own collectives send through the comm module
            assert m.comm_bytes == want["comm_bytes"] and m.comm_bytes >= GAS * 100
            assert m.peak_model_state_bytes == want["peak"] and m.peak_model_state_bytes > 0  # HighWater
            # "data": the batches came from the engine's own loader (initialize's training_data)
            assert set(m.timings) == {"data", "forward", "backward", "step"}
            assert all(t > 0 for t in m.timings.values())
            assert m.elapsed_s >= sum(m.timings.values())
        assert [m.global_samples for m in seen] == [8, 16, 24]
        assert [m.loss_scale for m in seen] == [256.0, 128.0, 128.0]  # halved by the overflow
        assert [m.skipped_steps for m in seen] == [0, 1, 1]


def test_sinks_from_env_build_named_factories(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {SINKS_ENV: f" {__name__}:env_sink , {__name__}:opt_out,"}
    sinks = sinks_from_env(env)
    assert sinks == [ENV_SEEN.append]
    assert sinks_from_env({}) == []


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("no_colon", "is not \"module:factory\""),
        ("deepfleet_no_such_module:f", "cannot import 'deepfleet_no_such_module'"),
        (f"{__name__}:missing", "has no 'missing'"),
        (f"{__name__}:GAS", "is not callable"),
        (f"{__name__}:not_a_sink", "returned int, not a callable sink"),
    ],
)
def test_sinks_from_env_errors_name_the_entry(entry: str, message: str) -> None:
    with pytest.raises(ValueError, match=SINKS_ENV + ".*" + message.replace("(", r"\(")):
        sinks_from_env({SINKS_ENV: entry})


def test_initialize_adds_the_environment_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    import deepfleet.engine as deepspeed

    monkeypatch.setenv(SINKS_ENV, f"{__name__}:env_sink")
    ENV_SEEN.clear()
    model = torch.nn.Linear(4, 1)
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 3, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    try:
        loss = engine(torch.ones(3, 4)).sum()
        engine.backward(loss)
        engine.step()
        assert [m.step for m in ENV_SEEN] == [1] and ENV_SEEN[0].tokens is None
        assert ENV_SEEN[0].loss == pytest.approx(float(loss.detach()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_count_tokens_prefers_input_ids() -> None:
    ids = torch.zeros(2, 5, dtype=torch.long)
    assert count_tokens(({"labels": torch.zeros(2, 7, dtype=torch.long), "input_ids": ids},), {}) == 10
    assert count_tokens((), {"input_ids": ids}) == 10
    assert count_tokens((torch.ones(2, 3), torch.zeros(4, dtype=torch.int32)), {}) == 4
    assert count_tokens((torch.ones(2, 3),), {"mask": torch.ones(2, dtype=torch.bool)}) is None
