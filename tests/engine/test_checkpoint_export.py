"""Consolidated safetensors export and the checkpoint CLI (engine/checkpoint/export.py, cli.py): the
export of a 2-rank FSDP2 checkpoint loads with plain safetensors and equals the full state dict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepfleet.engine.checkpoint.export import export_safetensors
from deepfleet.engine.checkpoint.io import StepWriter
from deepfleet.engine.checkpoint.layout import CheckpointError
from tests.engine.test_checkpoint_io import _fsdp_model_and_optim, _state, _train
from tests.spawn import spawn


def _save_and_full_state(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model, wrapped, optim = _fsdp_model_and_optim()
    _train(wrapped, optim, 1, rank=rank, world=world)
    fields = dict(global_steps=1, micro_steps=1, world_size=world, zero_stage=3, config_hash=None,
                  deepfleet_version="test", torch_version=torch.__version__)
    StepWriter().save(Path(root) / "global_step1", tensors=_state(model, optim), rank_state={},
                      shared_state={}, manifest_fields=fields)
    # full_state_dict gathers on every rank but returns {} on ranks != 0 with cpu_offload.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in full.items()}


pytestmark = pytest.mark.slow  # a 2-rank training run to export from


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("export")
    full = spawn(_save_and_full_state, 2, str(root))[0]
    return root, full


@pytest.mark.slow
def test_export_fp32_equals_full_state_dict(saved, tmp_path: Path) -> None:
    root, full = saved
    # A small budget forces many partial loads: the whole model is never in memory at once.
    report = export_safetensors(root / "global_step1", tmp_path / "m.safetensors", budget_bytes=16 << 10)
    loaded = load_file(tmp_path / "m.safetensors")
    assert set(loaded) == set(full) and report.tensors == len(full)
    for name, t in full.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], t), name
    largest = max(t.nbytes for t in full.values())
    assert report.peak_batch_bytes <= max(16 << 10, largest)
    assert report.peak_batch_bytes < sum(t.nbytes for t in full.values()) / 4


@pytest.mark.slow
def test_export_bf16(saved, tmp_path: Path) -> None:
    root, full = saved
    export_safetensors(root / "global_step1", tmp_path / "m.safetensors", dtype="bf16")
    loaded = load_file(tmp_path / "m.safetensors")
    for name, t in full.items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], t.to(torch.bfloat16)), name


def test_export_refuses_bad_dtype_and_incomplete(saved, tmp_path: Path) -> None:
    root, _ = saved
    with pytest.raises(CheckpointError, match="dtype: 'int4' is not supported"):
        export_safetensors(root / "global_step1", tmp_path / "m.safetensors", dtype="int4")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        export_safetensors(tmp_path / "partial", tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deepfleet.engine.checkpoint.cli", *args],
        capture_output=True, text=True, timeout=120,
    )


@pytest.mark.slow
def test_cli_inspect_and_export(saved, tmp_path: Path) -> None:
    root, full = saved
    listing = _cli("inspect", str(root), "--json")
    assert listing.returncode == 0, listing.stderr
    data = json.loads(listing.stdout)
    assert data["latest_complete"] == "global_step1"
    assert data["steps"] == [{"tag": "global_step1", "complete": True, "global_steps": 1}]

    step = _cli("inspect", str(root / "global_step1"), "--json", "--verify")
    assert step.returncode == 0, step.stderr
    info = json.loads(step.stdout)
    assert info["world_size"] == 2 and info["verified"] is True
    assert info["model_tensors"]["tok.weight"] == [[64, 32], "float32"]

    out = tmp_path / "m.safetensors"
    done = _cli("export", str(root), "--out", str(out), "--dtype", "bf16")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tensors"] == len(full)
    assert load_file(out)["tok.weight"].dtype == torch.bfloat16


def test_main_cli_forwards_checkpoint_commands(saved) -> None:
    root, _ = saved
    forwarded = subprocess.run(
        [sys.executable, "-m", "deepfleet.controller.cli", "checkpoint", "inspect", str(root), "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert forwarded.returncode == 0, forwarded.stderr
    assert json.loads(forwarded.stdout)["latest_complete"] == "global_step1"
    help_text = subprocess.run(
        [sys.executable, "-m", "deepfleet.controller.cli", "checkpoint", "--help"],
        capture_output=True, text=True, timeout=120,
    )
    assert help_text.returncode == 0 and "export" in help_text.stdout and "inspect" in help_text.stdout


@pytest.mark.slow
def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    missing = _cli("inspect", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"error: {tmp_path / 'nope'}: no such directory"
    empty = _cli("export", str(tmp_path), "--out", str(tmp_path / "x.safetensors"))
    assert empty.returncode == 2 and "holds no complete checkpoint" in empty.stderr
    assert "Traceback" not in empty.stderr
