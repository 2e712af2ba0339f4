"""The planner (`engine/planner/`): its per-rank peak-memory estimate against the high-water mark
measured on 2 gloo ranks (`planner_runs.py`), stages 0-3 x checkpointing on/off x 2 model sizes,
stages 1-3 with the optimizer state offloaded to NVMe files and stage 3 with the parameter shards there
too; and the memory-budget choice of blocks to checkpoint."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import tempfile

import pytest

from deepfleet.engine.config import load_config
from deepfleet.engine.planner.estimate import Choice, checkpoint_blocks_for_budget, estimate, plan
from tests.engine.planner_runs import SIZES, engine_config, gpt, measure_table, planned, profile, table_cases
from tests.spawn import spawn

CASES = table_cases()
TOLERANCE = 0.10
NVME = tempfile.mkdtemp(prefix="planner-nvme-")


@functools.cache
def _measured() -> list[list[dict]]:
    try:
        return spawn(measure_table, 2, CASES, NVME, timeout=300)
    finally:
        shutil.rmtree(NVME, ignore_errors=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_planner_is_within_10_percent_of_the_measured_high_water_mark(case: tuple) -> None:
    predicted = planned(case, NVME).total
    index = CASES.index(case)
    for rank, results in enumerate(_measured()):
        got = results[index]["peak"]
        # the window starts from the model state held between steps (none with everything in files)
        assert got > results[index]["start"] >= 0 and (results[index]["start"] > 0 or case[-1] == "nvme-param")
        error = (predicted - got) / got
        assert abs(error) <= TOLERANCE, f"rank {rank}: predicted {predicted:.0f} B, measured {got} B ({error:+.1%})"


def test_checkpointing_lowers_the_measured_peak_as_the_planner_says() -> None:
    by_case = {c: r for c, r in zip(CASES, _measured()[0], strict=True)}
    for size in SIZES:  # and NVMe offload takes the optimizer state out of memory
        for stage in (1, 2, 3):
            assert by_case[(size, stage, False, "nvme")]["peak"] < by_case[(size, stage, False)]["peak"]
    for size in SIZES:
        for stage in (0, 2):
            plain, ckpt = by_case[(size, stage, False)]["peak"], by_case[(size, stage, True)]["peak"]
            assert ckpt < plain, (size, stage)


def test_budget_mode_picks_the_fewest_blocks_that_fit() -> None:
    prof = profile("medium")
    cfg = load_config(engine_config(0), world_size=2)
    none = estimate(prof, cfg, world_size=2, choice=Choice(stage=0)).total
    every = estimate(prof, cfg, world_size=2, choice=Choice(stage=0, checkpoint=(0, 1, 2, 3))).total
    assert checkpoint_blocks_for_budget(prof, cfg, world_size=2, budget_bytes=none) == ()
    assert checkpoint_blocks_for_budget(prof, cfg, world_size=2, budget_bytes=every - 1) is None
    some = checkpoint_blocks_for_budget(prof, cfg, world_size=2, budget_bytes=(none + every) / 2)
    assert some and 0 < len(some) < 4
    assert estimate(prof, cfg, world_size=2, choice=Choice(stage=0, checkpoint=some)).total <= (none + every) / 2


def test_plan_covers_every_choice_and_offload_moves_bytes_to_its_tier() -> None:
    result = plan(engine_config(1), gpt, world_size=2, profile=profile("small"), budget_gib=1.0)
    stages = {e.choice.stage for e in result.estimates}
    assert stages == {0, 1, 2, 3}
    by = {(e.choice.stage, e.choice.offload_optimizer, e.choice.offload_param, bool(e.choice.checkpoint)): e
          for e in result.estimates}
    plain, cpu = by[(3, "none", "none", False)], by[(3, "cpu", "cpu", False)]
    assert cpu.total < plain.total and cpu.offloaded["cpu"] == pytest.approx(plain.optimizer + plain.params)
    assert by[(3, "nvme", "nvme", False)].offloaded["nvme"] == pytest.approx(plain.optimizer + plain.params)
    assert result.current.choice == Choice(stage=1)
    assert all(e["fits"] for e in result.to_dict()["estimates"])


def test_nvme_parameter_offload_moves_the_fp32_shards_to_files_less_max_in_cpu() -> None:
    prof = profile("small")
    shards = prof.num_params / 2 * 4  # this rank's fp32 shards at 2 ranks: what the unit files hold
    base = engine_config(3) | {"bf16": {"enabled": True}}
    off = Choice(stage=3, offload_param="nvme")
    plain = estimate(prof, load_config(base, world_size=2), world_size=2, choice=Choice(stage=3))
    # a candidate choice offloads every shard; 16-bit training's masters are those fp32 shards, so they go too
    est = estimate(prof, load_config(base, world_size=2), world_size=2, choice=off)
    assert est.offloaded["nvme"] == pytest.approx(shards) and "cpu" not in est.offloaded
    assert est.params == 0 and est.master == 0 and plain.master > 0
    assert est.nvme_transfer_bytes == pytest.approx(2 * shards)  # read back and written out every step
    # the config's own max_in_cpu keeps that many shard elements in host memory
    half = {**base, "zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": "/local_nvme", "max_in_cpu": int(prof.num_params / 4)}}}
    kept = estimate(prof, load_config(half, world_size=2), world_size=2, choice=off)
    assert kept.offloaded["nvme"] == pytest.approx(shards / 2) and kept.offloaded["cpu"] == pytest.approx(shards / 2)


def test_cli_prints_the_plan_as_json_and_names_a_bad_factory() -> None:
    cmd = [sys.executable, "-m", "deepfleet.engine.planner.cli", json.dumps(engine_config(2)),
           "--model", "tests.engine.planner_runs:gpt", "--world-size", "2", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    data = json.loads(out.stdout)
    assert data["model"]["params"] == sum(p.numel() for p in gpt()["model"].parameters())
    assert data["current"]["choice"]["stage"] == 2
    bad = subprocess.run([*cmd[:5], "tests.engine.planner_runs:nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--model" in bad.stderr and "nope" in bad.stderr
