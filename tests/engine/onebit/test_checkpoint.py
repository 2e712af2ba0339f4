"""Checkpoints of the 1-bit optimizers: each rank's error feedback travels in its own rank file, so a
resume at the same world size continues the uninterrupted loss curve exactly; at another world size the
errors start from zero and the optimizer logs that it reset them."""

from __future__ import annotations

import logging

import pytest

from tests.engine.onebit.onebit_runs import batches, make_engine, train
from tests.spawn import spawn

STEPS, SAVE_AT = 16, 10
PARAMS = {
    "OneBitAdam": {"lr": 2e-3, "freeze_step": 4},
    "ZeroOneAdam": {"lr": 2e-3, "var_freeze_step": 4, "var_update_scaler": 2, "local_step_clipper": 2,
                    "local_step_scaler": 2},
    "OneBitLamb": {"lr": 2e-2, "freeze_step": 4},
}


def _save_and_resume_all(rank: int, world: int, root: str) -> dict:
    return {name: _save_and_resume(rank, world, name, f"{root}/{name}") for name in PARAMS}


def _save_and_resume(rank: int, world: int, name: str, root: str) -> dict:
    data = batches(world, STEPS)
    whole = train(make_engine(name, PARAMS[name]), data, rank=rank, world_size=world)["loss"]
    first = make_engine(name, PARAMS[name])
    train(first, data[:SAVE_AT], rank=rank, world_size=world)
    first.save_checkpoint(root)
    resumed = make_engine(name, PARAMS[name])
    resumed.load_checkpoint(root)
    tail = train(resumed, data[SAVE_AT:], rank=rank, world_size=world)["loss"]
    return {"whole": whole, "tail": tail}


def test_resume_at_the_same_world_size_continues_the_curve(tmp_path) -> None:
    out = spawn(_save_and_resume_all, 2, str(tmp_path))[0]
    for name in PARAMS:
        assert out[name]["tail"] == pytest.approx(out[name]["whole"][SAVE_AT:], rel=1e-6, abs=1e-6), name


def _resume_elsewhere(rank: int, world: int, root: str) -> list[str]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("deepfleet.engine.onebit.base").addHandler(handler)
    engine = make_engine("OneBitAdam", PARAMS["OneBitAdam"])
    engine.load_checkpoint(root)
    losses = train(engine, batches(world, SAVE_AT + 3)[SAVE_AT:], rank=rank, world_size=world)["loss"]
    assert all(loss == loss for loss in losses)  # it trains on
    return records


def _save(rank: int, world: int, root: str) -> None:
    engine = make_engine("OneBitAdam", PARAMS["OneBitAdam"])
    train(engine, batches(world, SAVE_AT), rank=rank, world_size=world)
    engine.save_checkpoint(root)


@pytest.mark.slow  # 3 ranks on 2 cores: ~40 s
def test_resume_at_another_world_size_resets_the_errors_and_says_so(tmp_path) -> None:
    spawn(_save, 2, str(tmp_path))
    records = spawn(_resume_elsewhere, 3, str(tmp_path))
    assert all(any("OneBitAdam: error feedback reset (saved at world size None, now 3)" in r for r in rs)
               for rs in records), records
