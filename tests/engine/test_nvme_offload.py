"""ZeRO-Infinity optimizer-state offload to files (`offload_optimizer.device: nvme`,
engine/zero/nvme.py) on 2 gloo ranks at stages 1-3: losses equal the run without offload, the state
is in files between steps, a resume from a checkpoint continues like the uninterrupted run and never
reads a killed run's leftovers; a bad `nvme_path` is one line naming the key. Runs: `nvme_runs.py`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from deepfleet.engine.build import build_training
from deepfleet.engine.config import load_config
from tests.engine.nvme_runs import STEPS, stage_run
from tests.spawn import spawn


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn(stage_run, 2, str(tmp_path_factory.mktemp("nvme")))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_offload_trains_like_no_offload(runs: list[dict], stage: int) -> None:
    for r in runs:
        base, nvme = r[stage]["base"], r[stage]["nvme"]
        assert len(nvme) == STEPS
        assert max(abs(a - b) for a, b in zip(base, nvme, strict=True)) <= 1e-6, (base, nvme)
        assert r[stage]["resident_between_steps"] == 0  # no per-element state left in memory
        assert r[stage]["written"] > 0 and r[stage]["read"] > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_offload_resumes_from_a_checkpoint_and_ignores_leftovers(runs: list[dict], stage: int) -> None:
    for r in runs:
        assert r[stage]["files_before"] == []  # nothing before the first step
        assert r[stage]["leftovers"] == []  # a new engine cleared the killed run's .tmp and stale chunk
        assert r[stage]["tmp_after"] == []
        uninterrupted = r[stage]["nvme"][-len(r[stage]["resumed"]):]
        assert max(abs(a - b) for a, b in zip(uninterrupted, r[stage]["resumed"], strict=True)) <= 1e-6


# (section, stage, what the space check says it needs): optimizer-state and parameter offload share the
# path checks of zero/nvme_io.py and must name their own key
NVME_SECTIONS = [("offload_optimizer", 1, "the optimizer state needs"), ("offload_param", 3, "the parameter shards need")]


def _build(section_name: str, stage: int, path: str | None) -> None:
    section = {"device": "nvme"} if path is None else {"device": "nvme", "nvme_path": path}
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                       "zero_optimization": {"stage": stage, section_name: section}})
    build_training(nn.Linear(4, 4), cfg)


@pytest.mark.parametrize(("section", "stage", "needs"), NVME_SECTIONS, ids=[c[0] for c in NVME_SECTIONS])
def test_bad_nvme_path_is_one_line_naming_the_key(section: str, stage: int, needs: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    key = rf"^zero_optimization\.{section}\.nvme_path: "
    cases = {"missing": (str(tmp_path / "nope"), "does not exist"), "unset": (None, "required")}
    (tmp_path / "file").write_text("x")
    cases["file"] = (str(tmp_path / "file"), "not a directory")
    for name, (path, why) in cases.items():
        with pytest.raises(ValueError, match=key + f".*{why}.*;") as e:
            _build(section, stage, path)
        assert "\n" not in str(e.value), name
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match=key + ".*not writable"):
            _build(section, stage, str(locked))
    full = tmp_path / "full"
    full.mkdir()
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 10, 10))
    with pytest.raises(ValueError, match=key + f".*MiB free but {needs}") as e:
        _build(section, stage, str(full))
    assert "\n" not in str(e.value)
    assert not any(full.iterdir())  # checked before anything is written


@pytest.mark.parametrize("aio", [{"overlap_events": True}, {"overlap_events": False}, {"single_submit": True}])
def test_nvme_chunks_step_exactly_like_the_plain_optimizer(tmp_path: Path, aio: dict) -> None:
    """Single process, no strategy: the chunked step over files equals torch's AdamW step for step,
    with the read-ahead and background writes on and off, under each way of issuing the requests."""
    from types import SimpleNamespace

    from deepfleet.engine.config_zero import AioConfig
    from deepfleet.engine.zero.nvme import NvmeOptimizerOffload

    torch.manual_seed(0)
    ref = [torch.randn(7, 3), torch.randn(11), torch.randn(2, 2), torch.randn(1500)]  # 1500: several requests
    for pipeline in (False, True):
        mine = [t.clone() for t in ref]
        plain_t = [t.clone() for t in ref]
        plain = torch.optim.AdamW(plain_t, lr=1e-2, amsgrad=True)
        opt = torch.optim.AdamW(mine, lr=1e-2, amsgrad=True)
        plain_lr = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
        section = SimpleNamespace(buffer_count=2, pipeline_read=pipeline, pipeline_write=pipeline)
        off = NvmeOptimizerOffload(opt, section, AioConfig(block_size=4096, queue_depth=1, thread_count=2, **aio),
                                   chunk_elements=15, directory=tmp_path / f"p{pipeline}")
        lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # re-binds type(opt).step
        assert len(off.chunks) == 3
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for a, b in zip(mine, plain_t, strict=True):
                a.grad = torch.randn(a.shape, generator=g)
                b.grad = a.grad.clone()
            opt.step()
            plain.step()
            lr.step()
            plain_lr.step()
            assert all(torch.equal(a, b) for a, b in zip(mine, plain_t, strict=True))
            assert not opt.state  # between steps the state is in the files
        assert isinstance(opt, torch.optim.AdamW)
        off.materialize()
        for a, b in zip(mine, plain_t, strict=True):
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"):
                assert torch.equal(opt.state[a][key], plain.state[b][key]), key
        off.close()
