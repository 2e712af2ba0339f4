"""Checkpoint root layout (engine/checkpoint/layout.py, manifest.py): tags, the latest pointer, finding
the newest complete step, retention, and manifest validation. Torch-free and single-process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepfleet.engine.checkpoint import layout
from deepfleet.engine.checkpoint.layout import CheckpointError
from deepfleet.engine.checkpoint.manifest import (
    Manifest,
    read_manifest,
    sha256_file,
    verify_files,
    write_manifest,
)


def _step(root: Path, tag: str, global_steps: int, *, complete: bool = True) -> Path:
    """A step directory with one data file and a manifest; COMPLETE only when `complete`."""
    step = root / tag
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(bytes([global_steps]) * 100)
    (step / ".metadata").write_bytes(b"meta")
    files = {name: sha256_file(step / name) for name in ("__0_0.distcp", ".metadata")}
    write_manifest(
        step,
        Manifest(tag=tag, global_steps=global_steps, micro_steps=global_steps, world_size=2, zero_stage=3,
                 config_hash=None, deepfleet_version="0", torch_version="0", created_at="now", files=files),
    )
    if complete:
        layout.mark_complete(step)
    return step


def test_default_tag_and_tag_validation() -> None:
    assert layout.default_tag(12) == "global_step12"
    assert layout.validate_tag("epoch-3.final_v2") == "epoch-3.final_v2"
    for bad in ("", "../x", "a/b", ".hidden", "latest", "-x"):
        with pytest.raises(CheckpointError, match="is not a valid checkpoint tag"):
            layout.validate_tag(bad)


def test_latest_pointer_is_replaced_atomically(tmp_path: Path) -> None:
    assert layout.read_latest(tmp_path) is None
    layout.write_latest(tmp_path, "global_step1")
    layout.write_latest(tmp_path, "global_step2")
    assert layout.read_latest(tmp_path) == "global_step2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # no temp file left behind


def test_newest_complete_step_is_chosen_never_a_partial_one(tmp_path: Path) -> None:
    assert layout.find_latest_complete(tmp_path) is None
    _step(tmp_path, "global_step2", 2)
    _step(tmp_path, "global_step4", 4)
    _step(tmp_path, "global_step6", 6, complete=False)  # a save that died before COMPLETE
    assert layout.find_latest_complete(tmp_path) == "global_step4"
    # `latest` naming the partial directory (crash while it was overwritten) falls back too.
    layout.write_latest(tmp_path, "global_step6")
    assert layout.find_latest_complete(tmp_path) == "global_step4"
    layout.write_latest(tmp_path, "global_step2")
    assert layout.find_latest_complete(tmp_path) == "global_step2"  # an explicit pointer wins when complete
    listed = [(s.tag, s.complete) for s in layout.list_steps(tmp_path)]
    assert listed == [("global_step6", False), ("global_step2", True), ("global_step4", True)]


def test_retention_keeps_last_n_complete_and_drops_older_crash_leftovers(tmp_path: Path) -> None:
    import os

    _step(tmp_path, "global_step9", 9, complete=False)  # a save that crashed before this run resumed
    for n in (1, 2, 3, 4):
        _step(tmp_path, f"global_step{n}", n)
    _step(tmp_path, "global_step5", 5, complete=False)  # newer than the step just written: left alone
    for i, tag in enumerate(["global_step9", "global_step1", "global_step2", "global_step3", "global_step4",
                             "global_step5"]):
        os.utime(tmp_path / tag, (1000 + i, 1000 + i))
    layout.write_latest(tmp_path, "global_step4")
    deleted = layout.apply_retention(tmp_path, keep_last=2, protect="global_step4")
    assert deleted == ["global_step1", "global_step2", "global_step9"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3", "global_step4", "global_step5", "latest"]
    with pytest.raises(CheckpointError, match="keep_last: 0 must be >= 1"):
        layout.apply_retention(tmp_path, keep_last=0)


def test_unmark_complete_before_overwrite(tmp_path: Path) -> None:
    step = _step(tmp_path, "global_step1", 1)
    layout.unmark_complete(step)
    assert not layout.is_complete(step) and not (step / "manifest.json").exists()
    assert layout.find_latest_complete(tmp_path) is None


def test_manifest_round_trip_and_checks(tmp_path: Path) -> None:
    step = _step(tmp_path, "global_step3", 3)
    manifest = read_manifest(step)
    assert manifest.global_steps == 3 and manifest.total_bytes == 104
    verify_files(step, manifest)
    (step / "__0_0.distcp").write_bytes(bytes([9]) * 100)  # same size, different content
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: sha256 .* corrupted"):
        verify_files(step, manifest)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda m: m.update(format_version=99), "format_version 99 is newer than this deepfleet understands"),
        (lambda m: m.pop("format_version"), "format_version is missing"),
        (lambda m: m.update(world_size="two"), "world_size: Input should be a valid integer"),
        (lambda m: m.update(surprise=1), "surprise: Extra inputs are not permitted"),
    ],
)
def test_bad_manifest_is_named(tmp_path: Path, edit, message: str) -> None:
    step = _step(tmp_path, "global_step1", 1)
    raw = json.loads((step / "manifest.json").read_text())
    edit(raw)
    (step / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=message):
        read_manifest(step)


def test_missing_manifest(tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    with pytest.raises(CheckpointError, match=r"manifest.json: missing"):
        read_manifest(tmp_path / "s")
