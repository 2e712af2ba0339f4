"""ZeRO-Infinity parameter offload to files at stage 3 (`offload_param.device: nvme`,
engine/zero/nvme_param.py) on 2 gloo ranks: losses equal the run without offload (alone, with the
optimizer offload, under bf16), the shard storages are released after each step and the unit files have
the shards' sizes, a resume continues like the uninterrupted run, a write that fails half-way never
leaves a partial file under a final name and a resumed engine never reads the killed run's files (a bad
`nvme_path` is tested with the optimizer offload's, in test_nvme_offload.py, whose checks it shares).
Runs: `nvme_param_runs.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepfleet.engine.config import load_config
from tests.engine.nvme_param_runs import STEPS, losses_run, resume_run
from tests.spawn import spawn


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn(losses_run, 2, str(tmp_path_factory.mktemp("nvme-param")))


@pytest.fixture(scope="module")
def resumes(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn(resume_run, 2, str(tmp_path_factory.mktemp("nvme-param-resume")))


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


VARIANTS = [("param", "base"), ("both", "base"), ("param_bf16", "base_bf16"), ("param_ckpt", "base"),
            ("param_gas", "base_gas")]


@pytest.mark.parametrize(("name", "base"), VARIANTS)
def test_param_offload_trains_like_no_offload(runs: list[dict], name: str, base: str) -> None:
    """Alone, with the optimizer offload, under bf16, with activation checkpointing of the blocks (their
    recomputation inside backward) and with 2 micro-steps per optimizer step."""
    for r in runs:
        assert len(r[name]["losses"]) == len(r[base]) >= STEPS
        assert _close(r[name]["losses"], r[base]) <= 1e-6, (r[name]["losses"], r[base])
        assert r[name]["order"] == [0, 1, 2, 3]  # root, then the three blocks, as forward reaches them
        assert r[name]["written"] > 0 and r[name]["read"] > 0


def test_param_offload_composes_with_optimizer_offload(runs: list[dict]) -> None:
    for r in runs:
        assert r["both"]["optimizer_state_in_memory"] == 0  # per-element optimizer state in its own files
        assert r["both"]["optimizer_files"] > 0
        assert r["both"]["after"][-1]["storage_bytes"] == [0] * len(r["both"]["after"][-1]["storage_bytes"])


@pytest.mark.parametrize("name", [v for v, _ in VARIANTS])
def test_shards_are_released_after_each_step_and_files_hold_them(runs: list[dict], name: str) -> None:
    for r in runs:
        before = r[name]["before"]
        assert before["files"] == []  # nothing written before the first step
        assert all(n > 0 for n in before["storage_bytes"])  # every rank holds a padded shard of every param
        for after in r[name]["after"]:
            assert after["storage_bytes"] == [0] * len(before["storage_bytes"])
            assert after["resident"] == 0 and after["memory_params"] == 0
            # one file per FSDP unit, each with the unit's padded fp32 shards (also under bf16: the
            # fp32 shards are the master weights), none left as .tmp
            assert after["files"] == after["expected_files"]
            assert len(after["files"]) == after["units"] == 4


def test_reads_outside_forward_find_the_shards_in_memory(runs: list[dict]) -> None:
    for r in runs:
        o = r["param"]["outside"]
        assert o["state_dict_diff"] <= 1e-6 and o["gathered_diff"] <= 1e-6 and o["eval_diff"] <= 1e-6, o
        assert o["released_after_state_dict"] == 0  # zero_grad() released them again
        assert o["written_after_gathered"] > 0  # GatheredParameters may have changed the shard: written back
        # an evaluation forward reads each unit back and releases it as its forward ends (the root's stay
        # until the next zero_grad()); unchanged shards are released without a write
        assert o["resident_after_eval"] == o["unit_elements"][0] and o["resident_after_zero_grad"] == 0
        assert o["written_by_eval"] == 0


def test_blocks_leave_memory_between_their_forward_and_their_backward(runs: list[dict]) -> None:
    for r in runs:
        o = r["param"]["outside"]
        assert o["resident_after_forward"] == o["unit_elements"][0]  # only the root unit at the end of forward
        assert o["resident_after_backward"] == o["total_elements"]  # backward read every block back
        assert o["grad_diff"] <= 1e-6


def test_max_in_cpu_keeps_the_units_that_fit_in_memory(runs: list[dict]) -> None:
    for r in runs:
        kept = r["kept"]
        assert _close(kept["losses"], r["base"]) <= 1e-6
        assert kept["persistent"] == [True, False, False, False]  # the root unit fits, no block after it
        sizes = kept["after"]["storage_bytes"]
        assert all(n > 0 for n in sizes[:4]) and sizes[4:] == [0] * 6  # the root's 4 params stay in memory
        assert kept["after"]["resident"] == kept["root_elements"]
        assert sorted(kept["after"]["files"]) == ["unit0001.bin", "unit0002.bin", "unit0003.bin"]


def test_resume_from_a_checkpoint_continues_like_the_uninterrupted_run(resumes: list[dict]) -> None:
    for r in resumes:
        tail = r["uninterrupted"][-len(r["continued"]):]
        assert _close(tail, r["continued"]) <= 1e-6, (tail, r["continued"])
        for state in (r["after_save"], r["after_first_step"]):  # a save pages the shards in and out again
            assert state["storage_bytes"] == [0] * len(state["storage_bytes"])
            assert state["files"] == state["expected_files"]
        # a loaded engine keeps its shards in memory until its first forward (FSDP2's lazy init re-pads
        # them from their storages), and writes the loaded ones out at the end of its first step
        assert all(n > 0 for n in r["after_load"]["storage_bytes"]) and r["after_load"]["files"] == {}


def test_a_failed_write_never_leaves_a_partial_file_under_its_final_name(resumes: list[dict]) -> None:
    for r in resumes:
        assert r["raised"] is not None and "No space left" in r["raised"]
        assert r["files_after_fail"] == r["files_before_fail"]  # no new final names
        assert len(r["changed_files"]) == 1  # the unit written before the failure landed whole
        assert r["tmp"] == [r["files_before_fail"][1] + ".tmp"]  # the half-written one is only a .tmp
        assert r["kept_resident"] == [1, 2, 3]  # the failed unit and the ones after keep their shards
        assert r["leftovers"] == []  # a new engine clears the killed run's files before anything reads them
        tail = r["uninterrupted"][-len(r["after_kill"]):]
        assert _close(tail, r["after_kill"]) <= 1e-6, (tail, r["after_kill"])


def test_param_nvme_needs_stage_3() -> None:
    with pytest.raises(ValueError, match=r"offload_param: parameter offload needs stage 3"):
        load_config({"train_micro_batch_size_per_gpu": 1,
                     "zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}})


def test_storage_bytes_view_reads_and_writes_in_place(tmp_path: Path) -> None:
    """Single process: a unit-style file round trip through BlockIO lands in the storage itself."""
    from deepfleet.engine.config_zero import AioConfig
    from deepfleet.engine.zero.nvme_io import BlockIO, storage_bytes

    io = BlockIO(AioConfig(block_size=4096, queue_depth=2, thread_count=2), key="k")
    t = torch.arange(3000, dtype=torch.float32)  # 12000 bytes: three requests
    want = t.clone()
    s = t.untyped_storage()
    io.write_file(tmp_path / "u.bin", [(64, storage_bytes(s))], size=64 + 12032)
    s.resize_(0)
    assert t.untyped_storage().nbytes() == 0
    s.resize_(12000)
    io.read_file(tmp_path / "u.bin", [(64, storage_bytes(s))])
    assert torch.equal(t, want)
    assert (tmp_path / "u.bin").stat().st_size == 64 + 12032
    io.close()
