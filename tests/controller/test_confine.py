"""Path confinement on disk: symlinks out of a root are refused, job areas are owner-only, exit files
planted as links are not followed, and resumeFrom copies only a complete checkpoint of the source job."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from deepfleet.controller.backends.local import _SIGKILLED, _read_exit
from deepfleet.controller.confine import (
    ConfineError,
    copy_resume_checkpoint,
    factory_error,
    job_area,
    job_area_path,
    resolve_inside,
    static_path_error,
)


def test_a_symlink_out_of_the_root_is_refused(tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text("print(1)\n")
    (code / "evil.py").symlink_to("/etc/passwd")
    (code / "up").symlink_to(tmp_path)
    assert resolve_inside(code, "train.py", field="f") == (code / "train.py").resolve()
    for path in ("evil.py", "up/secret", "../x", "/etc/passwd"):
        with pytest.raises(ConfineError, match=r"^f: .* resolves outside"):
            resolve_inside(code, path, field="f")


def test_static_checks_and_factory_rule() -> None:
    assert static_path_error("runs/ck", field="f") is None
    assert "absolute" in static_path_error("/x", field="f") and "'..'" in static_path_error("a/../../x", field="f")
    assert factory_error("examples.gpt.factories:build", allowed=()) is None
    assert factory_error("os:system", allowed=()) is not None
    assert factory_error("os.path:join", allowed=("os.path",)) is None


def test_job_areas_are_owner_only_under_unlistable_parents(tmp_path: Path) -> None:
    area = job_area(tmp_path / "jobs", project="alpha", job_id="j1")
    assert stat.S_IMODE(area.root.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "jobs" / "alpha").stat().st_mode) == 0o711
    with pytest.raises(ConfineError):
        job_area_path(tmp_path, project="../x", job_id="j")


def test_an_exit_file_planted_as_a_link_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "ok.exit").write_text("76")
    assert _read_exit(tmp_path / "ok.exit")[0] == 76
    (tmp_path / "bad.exit").symlink_to("/etc/passwd")
    assert _read_exit(tmp_path / "bad.exit") == (_SIGKILLED, 0.0)
    (tmp_path / "junk.exit").write_text("root:x:0:0")
    assert _read_exit(tmp_path / "junk.exit")[0] == _SIGKILLED
    assert _read_exit(tmp_path / "none.exit") is None


def test_resume_from_copies_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    source = job_area(tmp_path, project="alpha", job_id="old")
    ck = source.checkpoints / "ck"
    (ck / "global_step4").mkdir(parents=True)
    (ck / "global_step4" / "COMPLETE").write_text("")
    (ck / "global_step4" / "shard").write_text("w")
    (ck / "latest").write_text("global_step4")
    target = job_area(tmp_path, project="alpha", job_id="new")
    assert copy_resume_checkpoint(source, into=target.checkpoints / "ck") == "global_step4"
    assert (target.checkpoints / "ck" / "global_step4" / "shard").read_text() == "w"
    (ck / "latest").write_text("global_step9")  # not complete: nothing to copy
    empty = job_area(tmp_path, project="alpha", job_id="other")
    assert copy_resume_checkpoint(source, into=empty.checkpoints / "ck") is None
    assert not os.path.exists(empty.checkpoints / "ck" / "latest")
