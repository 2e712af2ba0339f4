"""The `communication` compression policy (`engine/gradcomp/`): int8/int4 block quantization round-trips
within half a step per block; on 2 gloo ranks the gradient reduction of ZeRO stages 0, 1 and 2 is
compressed, and at stage 3 FSDP2's reduce-scatter through its hook (fewer wire bytes, loss close to the
uncompressed run), the guard reports its relative error
and loss delta in the step metrics, and a bad compressor makes it fall back and say so."""

from __future__ import annotations

import logging

import pytest
import torch

from deepfleet.engine.config import load_config
from deepfleet.engine.gradcomp.quantize import QMAX, dequantize, quantize
from tests.engine.onebit.onebit_runs import batches, make_engine, train
from tests.spawn import spawn

STEPS = 8
ADAM = {"lr": 2e-3}


@pytest.mark.parametrize("bits", [8, 4])
def test_block_quantization_round_trips_within_half_a_step(bits: int) -> None:
    x = torch.randn(6 * 64) * torch.arange(6).repeat_interleave(64)  # a block of zeros, then growing scales
    codes, scales = quantize(x, bits=bits, block=64)
    assert codes.numel() == (x.numel() if bits == 8 else x.numel() // 2) and scales.numel() == 6
    back = dequantize(codes, scales, bits=bits, block=64)
    assert torch.all((back - x).abs().view(6, 64) <= scales[:, None] / 2 + 1e-6)
    assert torch.equal(back[:64], torch.zeros(64))
    assert torch.allclose(scales, x.view(6, 64).abs().amax(1) / QMAX[bits])


def test_stage_3_is_accepted() -> None:
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                       "communication": {"compression": "int8"}})
    assert cfg.communication.compression == "int8"


class _BadCodec:
    """Decodes everything to zeros: the reduction it produces is useless, which the guard must catch."""

    block = 256

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(x.numel(), dtype=torch.int8), torch.zeros(x.numel() // self.block)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch.zeros(codes.numel())


def _runs(rank: int, world: int) -> dict:
    data = batches(world, STEPS)
    out = {}
    for stage in (0, 1, 2, 3):
        zero = {"stage": stage, "reduce_bucket_size": 20000}
        out[("none", stage)] = train(make_engine("Adam", ADAM, zero_optimization=zero), data, rank=rank,
                                     world_size=world)
        for kind in ("int8", "int4") if stage == 0 else ("int8",):
            section = {"compression": kind, "guard": {"interval": 4, "max_relative_error": 0.5}}
            engine = make_engine("Adam", ADAM, zero_optimization=zero, communication=section)
            out[(kind, stage)] = train(engine, data, rank=rank, world_size=world)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("deepfleet.engine.gradcomp.policy").addHandler(handler)
    engine = make_engine("Adam", ADAM, communication={"compression": "int8", "guard": {"interval": 2}})
    engine.comm_policy.codec = _BadCodec()
    out["bad"] = train(engine, data[:4], rank=rank, world_size=world)
    out["bad_log"] = records
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    return spawn(_runs, 2, timeout=600)[0]


@pytest.mark.parametrize(("kind", "stage", "ratio"), [("int8", 0, 0.40), ("int4", 0, 0.22), ("int8", 1, 0.40),
                                                      ("int8", 2, 0.40)])
def test_compressed_reduction_cuts_bytes_and_keeps_the_loss(runs: dict, kind: str, stage: int, ratio: float) -> None:
    plain, packed = runs[("none", stage)], runs[(kind, stage)]
    # stages 1/2 also all-gather the updated parameters (uncompressed): the bytes above stage 0's
    gather = min(plain["bytes"]) - min(runs[("none", 0)]["bytes"])
    grads = [b - gather for step, b in enumerate(packed["bytes"], 1) if step % 4]  # guard steps also reduce exactly
    assert max(grads) <= ratio * (min(plain["bytes"]) - gather), (kind, stage, max(grads), min(plain["bytes"]))
    assert packed["loss"][-1] == pytest.approx(plain["loss"][-1], rel=0.03)
    checks = [g for step, g in enumerate(packed["guard"], 1) if step % 4 == 0]
    assert all(on and err is not None and err < 0.5 for on, err, _ in checks)
    assert checks[1][2] is not None and checks[1][2] < 0  # loss delta since the previous check: it fell
    assert all(err is None for step, (_, err, _) in enumerate(packed["guard"], 1) if step % 4)


def test_stage_3_reduce_scatter_is_compressed(runs: dict) -> None:
    """FSDP2's per-block reduce-scatters go through the policy: the gradient bytes drop to about the int8
    share (parameter all-gathers stay fp32, so the total drops less), the loss stays close, the guard checks."""
    plain, packed = runs[("none", 3)], runs[("int8", 3)]
    compressed_steps = [b for step, b in enumerate(packed["bytes"], 1) if step % 4]
    assert max(compressed_steps) < 0.8 * min(plain["bytes"]), (max(compressed_steps), min(plain["bytes"]))
    assert packed["loss"][-1] == pytest.approx(plain["loss"][-1], rel=0.03)
    checks = [g for step, g in enumerate(packed["guard"], 1) if step % 4 == 0]
    assert all(on and err is not None and err < 0.5 for on, err, _ in checks)


def test_a_bad_compressor_makes_the_guard_fall_back_and_say_so(runs: dict) -> None:
    guard = runs["bad"]["guard"]
    assert guard[0] == (True, None, None)
    assert guard[1][0] is True and guard[1][1] == pytest.approx(1.0)  # the check step still used exact sums
    assert [on for on, _, _ in guard[2:]] == [False, False]
    assert any("relative error 1 > guard.max_relative_error 0.5 at step 2; falling back" in r
               for r in runs["bad_log"]), runs["bad_log"]
