"""Start a training job from another job's checkpoint that the backend mounted read-only.

Called by `worker/agent.py` on every node before the launch, when the WorkerSpec has `resume_dir` (the
Kubernetes backend mounts the source job's claim directory there; Azure ML passes its checkpoint input
with `deepfleet-worker --resume-dir`). If the job's own `checkpoint.dir` holds no complete checkpoint
(the first attempt), the newest complete one of `resume_dir` is copied in as `<dir>/<tag>` and `latest`
names it, so the training code resumes from `checkpoint.dir` as it always does, and later attempts
resume from their own newer checkpoints. `resume_dir` is only read: the copy's files get this process's
modes (not the source's read-only ones), so retention can delete them later.

Several nodes may share `checkpoint.dir` (one ReadWriteMany claim) and all run this: each copies into a
private temporary directory beside the target and renames it into place; the first rename wins and the
others discard theirs. The COMPLETE marker is copied last, so a copy cut short is never loaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def seed_from(resume_dir: str | Path, *, into: str | Path) -> str | None:
    """Copy the newest complete checkpoint of `resume_dir` into `into` unless `into` has a complete one;
    returns the copied tag, or None when nothing was copied (`into` has its own, or `resume_dir` none).
    Raises OSError when `resume_dir` cannot be read or `into` written."""
    from deepfleet.engine.checkpoint.layout import COMPLETE, find_latest_complete, is_complete, write_latest

    own, source = Path(into), Path(resume_dir)
    if find_latest_complete(own) is not None:
        return None  # an earlier attempt of this job saved its own: resume from that
    if not source.is_dir():
        raise FileNotFoundError(f"resume_dir {source} does not exist (the backend mounts the source checkpoint "
                                "there)")
    tag = find_latest_complete(source)
    if tag is None:
        return None
    own.mkdir(parents=True, exist_ok=True)
    target = own / tag
    if not is_complete(target):
        if target.exists():  # no COMPLETE (a save cut short): never loaded, replaced now (by any one node)
            shutil.rmtree(target, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{tag}.copy-", dir=own))
        try:
            _copy_tree(source / tag, staging, last=COMPLETE)
            try:
                os.rename(staging, target)
            except OSError:
                if not is_complete(target):  # not another node's copy: a real failure
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    write_latest(own, tag)
    return tag


def _copy_tree(src: Path, dst: Path, *, last: str) -> None:
    """Copy the files under `src` into `dst` (contents only, with default modes; links are not followed
    out of `src`), the top-level file `last` after everything else."""
    for root, dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        for d in dirs:
            (dst / rel / d).mkdir(exist_ok=True)
        for f in files:
            if rel == Path(".") and f == last:
                continue
            if (Path(root) / f).is_symlink():
                continue  # a checkpoint holds plain files only; a planted link is not followed
            shutil.copyfile(Path(root) / f, dst / rel / f)
    if (src / last).is_file() and not (src / last).is_symlink():
        shutil.copyfile(src / last, dst / last)
