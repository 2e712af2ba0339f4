"""Checkpoint directory layout: step directories, the COMPLETE marker, the `latest` pointer, retention.

A checkpoint root holds one directory per saved step (default tag `global_step<N>`) and a `latest`
file naming the newest complete tag:

    <root>/latest                      text: the tag, replaced atomically (os.replace)
    <root>/<tag>/.metadata             DCP metadata (global shapes, dtypes, chunk locations)
    <root>/<tag>/__<rank>_<i>.distcp   DCP shards, one or more per rank
    <root>/<tag>/rank<r>.pt            per-rank state (RNG, data position), see state.py
    <root>/<tag>/engine_state.pt       rank-0 state (steps, LR scheduler, loss scaler, client state)
    <root>/<tag>/manifest.json         format version, topology, versions, sizes and sha256 of each file
    <root>/<tag>/COMPLETE              written last, after every rank finished writing

A step directory without COMPLETE is an interrupted save and is never loaded: `latest` may name it only
while it is being overwritten, so readers fall back to the newest complete directory. This module is
torch-free so the worker (which reports the last complete checkpoint) and the inspection CLI can use it.
Callers: io.py (writes), api.py (resolves what to load), cli.py (inspect).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
LATEST = "latest"
FORMAT_VERSION = 1

_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or loaded as asked; the message names the file and the problem."""


def default_tag(global_steps: int) -> str:
    """The tag of a checkpoint taken after `global_steps` optimizer steps."""
    return f"global_step{global_steps}"


def validate_tag(tag: str) -> str:
    """Return `tag` if it is a plain directory name, else raise CheckpointError naming the fix."""
    if not isinstance(tag, str) or not _TAG_RE.match(tag) or tag == LATEST:
        raise CheckpointError(
            f"tag: {tag!r} is not a valid checkpoint tag; use letters, digits, '.', '_' or '-' "
            f"(not starting with '.' or '-', and not {LATEST!r})"
        )
    return tag


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so readers see either the old file or the whole new one (fsync + os.replace)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename durable; not every filesystem allows opening a directory, which is harmless.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_complete(step_dir: Path) -> bool:
    """True when the save of `step_dir` finished on every rank (its COMPLETE marker exists)."""
    return (step_dir / COMPLETE).is_file()


def mark_complete(step_dir: Path) -> None:
    """Write the COMPLETE marker (the last file of a save)."""
    atomic_write(step_dir / COMPLETE, b"ok\n")


def unmark_complete(step_dir: Path) -> None:
    """Remove COMPLETE and the manifest before a directory is overwritten, so a crash mid-overwrite
    leaves an incomplete directory rather than a 'complete' one with mixed files."""
    for name in (COMPLETE, MANIFEST):
        try:
            (step_dir / name).unlink()
        except FileNotFoundError:
            pass
    _fsync_dir(step_dir)


def read_latest(root: Path) -> str | None:
    """The tag named by `<root>/latest`, or None when there is no such file."""
    try:
        tag = (Path(root) / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return tag or None


def write_latest(root: Path, tag: str) -> None:
    """Point `<root>/latest` at `tag`, atomically."""
    atomic_write(Path(root) / LATEST, (validate_tag(tag) + "\n").encode())


@dataclass(frozen=True)
class StepInfo:
    """One step directory under a checkpoint root, as found on disk."""

    tag: str
    path: Path
    complete: bool
    global_steps: int | None  # from the manifest; None when it cannot be read
    mtime: float


def _manifest_steps(step_dir: Path) -> int | None:
    try:
        return int(json.loads((step_dir / MANIFEST).read_text())["global_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def list_steps(root: Path) -> list[StepInfo]:
    """Every step directory under `root` (complete or not), oldest first.

    A directory counts as a step directory when it holds DCP metadata, a manifest or a COMPLETE marker.
    Order: by global_steps from the manifest when known, then by modification time.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if not child.is_dir() or not _TAG_RE.match(child.name):
            continue
        if not any((child / name).exists() for name in (".metadata", MANIFEST, COMPLETE)):
            continue
        complete = is_complete(child)
        found.append(
            StepInfo(
                tag=child.name,
                path=child,
                complete=complete,
                global_steps=_manifest_steps(child) if complete else None,
                mtime=child.stat().st_mtime,
            )
        )
    found.sort(key=lambda s: (s.global_steps if s.global_steps is not None else -1, s.mtime, s.tag))
    return found


def find_latest_complete(root: Path) -> str | None:
    """The tag to resume from: `latest` when it names a complete directory, else the newest complete one.

    Never returns an incomplete directory; None when `root` holds no complete checkpoint.
    """
    root = Path(root)
    tag = read_latest(root)
    if tag is not None and _TAG_RE.match(tag) and is_complete(root / tag):
        return tag
    complete = [s for s in list_steps(root) if s.complete]
    return complete[-1].tag if complete else None


def apply_retention(root: Path, *, keep_last: int, protect: str | None = None) -> list[str]:
    """Delete the oldest complete step directories so at most `keep_last` remain; return deleted tags.

    `protect` (the tag just written) and the tag named by `latest` are never deleted. Incomplete
    directories older than `protect` are leftovers of saves that crashed (a training process has one
    save in flight at a time, and it has just completed) and are deleted too; newer ones are left alone.
    """
    if keep_last < 1:
        raise CheckpointError(f"keep_last: {keep_last} must be >= 1 (or None to keep every checkpoint)")
    root = Path(root)
    keep = {protect, read_latest(root)}
    steps = list_steps(root)
    complete = [s for s in steps if s.complete]
    excess = len(complete) - keep_last
    doomed = []
    for step in complete:
        if excess <= 0:
            break
        if step.tag not in keep:
            doomed.append(step)
            excess -= 1
    newest = next((s.mtime for s in steps if s.tag == protect), None)
    if newest is not None:
        doomed += [s for s in steps if not s.complete and s.tag not in keep and s.mtime < newest]
    for step in doomed:
        # COMPLETE goes first, so a crash half-way through the delete leaves an incomplete directory.
        (step.path / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(step.path, ignore_errors=True)
    return [s.tag for s in doomed]
