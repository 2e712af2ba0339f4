"""The comms logger: on 2 gloo ranks, the per-op counts and bytes it reports equal the collectives
issued (through the engine's comm module and through a training run), with bandwidths from the NCCL
tests' definitions; `prof_all: false` keeps only `prof_ops`; summaries are logged every
`steps_per_print` steps and at the end of training; and the wall-clock breakdown's shares add up."""

from __future__ import annotations

import logging

import pytest
import torch

from deepfleet.engine.config import load_config
from deepfleet.engine.metrics import StepMetrics
from deepfleet.engine.profiling.breakdown import WallClockBreakdown
from deepfleet.engine.profiling.comms_logger import CommsLogger, OpSummary, bus_factor
from tests.spawn import spawn


def issue_known_collectives(rank: int, world_size: int) -> dict:
    from deepfleet.engine import comm

    section = load_config({"train_micro_batch_size_per_gpu": 1, "comms_logger": {"enabled": True}}).comms_logger
    logger = CommsLogger(section, steps_per_print=None, rank=rank, world_size=world_size)
    only = CommsLogger(load_config({"train_micro_batch_size_per_gpu": 1, "comms_logger": {
        "enabled": True, "prof_all": False, "prof_ops": ["broadcast"]}}).comms_logger,
        steps_per_print=None, rank=rank, world_size=world_size)
    x = torch.ones(1000)
    for _ in range(3):
        comm.all_reduce(x)
    out = torch.empty(2 * 10, dtype=torch.float64)
    for _ in range(2):
        comm.all_gather_into_tensor(out, torch.ones(10, dtype=torch.float64))
    work = comm.reduce_scatter_tensor(torch.empty(8), torch.ones(16), async_op=True)
    work.wait()
    comm.broadcast(torch.zeros(7, dtype=torch.int32), src=0)
    return {"all": {r.name: (r.count, r.bytes, r.seconds > 0, r.algbw, r.busbw, r.latency_s) for r in logger.summary()},
            "only": [r.name for r in only.summary()]}


def test_counts_and_bytes_equal_the_collectives_issued() -> None:
    for result in spawn(issue_known_collectives, 2):
        rows = result["all"]
        assert {k: v[:3] for k, v in rows.items()} == {
            "all_reduce": (3, 3 * 1000 * 4, True),
            "all_gather_into_tensor": (2, 2 * 10 * 8, True),
            "reduce_scatter_tensor": (1, 16 * 4, True),
            "broadcast": (1, 7 * 4, True),
        }
        assert result["only"] == ["broadcast"]
        for name, (count, nbytes, _, algbw, busbw, latency) in rows.items():
            seconds = latency * count
            message = nbytes * (2 if name.startswith("all_gather") else 1)
            assert algbw == pytest.approx(message / seconds)
            assert busbw == pytest.approx(algbw * bus_factor(name, 2))
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather_into_tensor", 4) == 0.75
    assert bus_factor("broadcast", 4) == 1.0 and OpSummary("send", 0, 0, 0.0, 2).algbw == 0.0


def train_with_comms_logger(rank: int, world_size: int) -> dict:
    import deepfleet.engine as deepspeed
    from deepfleet.engine import comm
    from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("deepfleet.engine.profiling")
    log.addHandler(Keep())
    log.setLevel(logging.INFO)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=1)
    engine, _, loader, _ = deepspeed.initialize(
        model=GPTWithLoss(cfg), training_data=SyntheticTokens(num_samples=64, seq_len=16, vocab_size=64),
        config={"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2, "wall_clock_breakdown": True,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": 1},
                "comms_logger": {"enabled": True}})
    before = comm.counters()
    for i, batch in enumerate(loader):
        if i == 3:
            break
        engine.backward(engine(batch))
        engine.step()
    after = comm.counters()
    logger = next(s for s in engine.sinks if isinstance(s, CommsLogger))
    breakdown = next(s for s in engine.sinks if isinstance(s, WallClockBreakdown))
    engine.destroy()
    issued = {k: (c.count - before.get(k, type(c)()).count, c.bytes - before.get(k, type(c)()).bytes)
              for k, c in after.items() if c.count - before.get(k, type(c)()).count}
    return {"issued": issued, "logged": {r.name: (r.count, r.bytes) for r in logger.summary()},
            "messages": [r.getMessage() for r in records], "shares": breakdown.shares()}


@pytest.mark.slow
def test_a_training_run_logs_what_it_issued_every_steps_per_print_and_at_the_end() -> None:
    results = spawn(train_with_comms_logger, 2)
    for rank, result in enumerate(results):
        assert result["issued"] and result["logged"] == result["issued"]
        summaries = [m for m in result["messages"] if m.startswith("comms summary")]
        if rank == 0:
            assert [m.split(",")[2].split("(")[0].strip() for m in summaries] == ["after step 2", "end of training"]
            assert any(m.startswith("wall clock breakdown, end of training") for m in result["messages"])
        else:
            assert summaries == []  # rank 0 only without debug
        shares = result["shares"]
        assert sum(shares[k] for k in ("forward", "backward", "step", "checkpoint", "data_loading", "other")) == pytest.approx(1.0)
        assert 0 < shares["communication"] < 1


def test_breakdown_shares_from_step_timings() -> None:
    b = WallClockBreakdown(steps_per_print=None, rank=0)
    m = StepMetrics(step=1, rank=0, loss=1.0, lr=0.1, lrs=(0.1,), grad_norm=None, loss_scale=1.0, skipped=False,
                    skipped_steps=0, samples=2, global_samples=2, tokens=None, elapsed_s=2.0,
                    timings={"forward": 0.5, "backward": 1.0, "step": 0.3})
    b(m)
    b(m)
    assert b.shares() == pytest.approx({"forward": 0.25, "backward": 0.5, "step": 0.15, "checkpoint": 0.0,
                                        "communication": 0.0, "data_loading": 0.1, "other": 0.0})
    assert "data_loading" in b.table()


def test_breakdown_splits_the_engines_own_batch_fetches_from_the_rest_of_the_loop() -> None:
    b = WallClockBreakdown(steps_per_print=None, rank=0)
    b(StepMetrics(step=1, rank=0, loss=1.0, lr=0.1, lrs=(0.1,), grad_norm=None, loss_scale=1.0, skipped=False,
                  skipped_steps=0, samples=2, global_samples=2, tokens=None, elapsed_s=2.0,
                  timings={"data": 0.15, "forward": 0.5, "backward": 1.0, "step": 0.3}))
    assert b.shares() == pytest.approx({"forward": 0.25, "backward": 0.5, "step": 0.15, "checkpoint": 0.0,
                                        "communication": 0.0, "data_loading": 0.075, "other": 0.025})


def test_checkpoint_seconds_reach_the_next_step_and_the_breakdown(tmp_path) -> None:
    import torch.distributed as dist

    import deepfleet.engine as deepspeed

    model = torch.nn.Linear(4, 2)
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "wall_clock_breakdown": True,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    seen: list[StepMetrics] = []
    engine.sinks.append(seen.append)
    try:
        for i in range(2):
            engine.backward(engine(torch.ones(2, 4)).sum())
            engine.step()
            if i == 0:
                engine.save_checkpoint(tmp_path, tag="one")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert "checkpoint" not in seen[0].timings and seen[1].timings["checkpoint"] > 0
    breakdown = next(s for s in engine.sinks if isinstance(s, WallClockBreakdown))
    assert breakdown.totals["checkpoint"] == seen[1].timings["checkpoint"]
