"""Writing and reading one step directory on torch.distributed.checkpoint (DCP).

Caller: api.py (engine save/load) and the tests. DCP does the sharded tensor I/O and the resharding:
every rank writes its shards of the {"model", "optim"} state dict (DTensor Shard(0) or plain tensors),
and a load maps whatever layout was saved onto the current one. What DCP lacks, and this module adds:

- a completion protocol: after every rank finished writing, each rank hashes its own files, rank 0
  gathers the hashes, writes `manifest.json`, then `COMPLETE`, then points `latest` at the tag and
  applies retention; a crash anywhere before COMPLETE leaves a directory that is never loaded;
- async save: `dcp.async_save` stages a copy of the tensors and writes in a background thread while
  training continues; the completion protocol runs in one more background thread once the write is
  done. Both use a dedicated gloo process group, so their collectives never interleave with the
  training loop's collectives on the default group;
- verified loads: sizes and sha256 of every file (each rank checks a share), and the saved global
  shapes compared with the current model's before DCP reads anything, so a different model or a
  corrupted shard fails with CheckpointError instead of loading partially.
"""

from __future__ import annotations

import datetime
import fnmatch
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from deepfleet.engine import comm
from deepfleet.engine.checkpoint import layout
from deepfleet.engine.checkpoint.layout import CheckpointError
from deepfleet.engine.checkpoint.manifest import (
    FileEntry,
    Manifest,
    read_manifest,
    sha256_file,
    verify_files,
    write_manifest,
)
from deepfleet.engine.checkpoint.state import ENGINE_STATE, load_small, rank_file, save_small

log = logging.getLogger(__name__)

# Files a rank wrote and therefore hashes; rank 0 also hashes whatever nobody claimed.
_RANK0_FILES = (".metadata", ENGINE_STATE)


def _rank() -> int:
    return comm.get_rank()


def _world() -> int:
    return comm.get_world_size()


def flat_tensors(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensor leaves of a nested dict, keyed the way DCP flattens them ("model.blocks.0.fc.weight")."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out[name] = value
        elif isinstance(value, dict):
            out.update(flat_tensors(value, prefix=f"{name}."))
    return out


class StepWriter:
    """Writes step directories for one training process; at most one async save is in flight.

    Create it after the default process group exists (it creates its own gloo group, a collective).
    """

    def __init__(self) -> None:
        self.group = (
            comm.new_group(backend="gloo", timeout=datetime.timedelta(minutes=30)) if comm.is_initialized() else None
        )
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def save(
        self,
        step_dir: Path,
        *,
        tensors: dict[str, Any],
        rank_state: dict[str, Any],
        shared_state: dict[str, Any] | None,
        manifest_fields: dict[str, Any],
        async_save: bool = False,
        keep_last: int | None = None,
        update_latest: bool = True,
    ) -> Future | None:
        """Write `step_dir`; return a Future for an async save (done when COMPLETE is written), else None.

        `shared_state` is written by rank 0 only. Raises CheckpointError (on every rank) if a rank
        failed to write its files.
        """
        self.wait()
        step_dir = Path(step_dir)
        rank = _rank()
        if rank == 0:
            step_dir.mkdir(parents=True, exist_ok=True)
            layout.unmark_complete(step_dir)
        self._barrier()
        step_dir.mkdir(parents=True, exist_ok=True)
        # Small state is captured now, at the step boundary, even when the tensors are written later.
        save_small(step_dir / rank_file(rank), rank_state)
        if rank == 0:
            save_small(step_dir / ENGINE_STATE, shared_state or {})
        finish = _Finisher(
            step_dir,
            group=self.group,
            manifest_fields={**manifest_fields, "async_save": async_save},
            keep_last=keep_last,
            update_latest=update_latest,
        )
        if not async_save:
            dcp.save(tensors, checkpoint_id=step_dir, process_group=self.group)
            finish()
            return None
        written = dcp.async_save(tensors, checkpoint_id=step_dir, process_group=self.group)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepfleet-ckpt")
        self._pending = self._executor.submit(_finish_after, written, finish)
        return self._pending

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is complete; re-raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the in-flight save and stop the background thread."""
        self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _barrier(self) -> None:
        if self.group is not None:
            comm.barrier(group=self.group)


def _finish_after(written: Any, finish: Callable[[], None]) -> None:
    # dcp.async_save returns a Future, or an AsyncSaveResponse when a custom stager is used.
    (written.upload_completion if hasattr(written, "upload_completion") else written).result()
    finish()


class _Finisher:
    """The completion protocol, run once every rank has finished writing its files (see module doc)."""

    def __init__(
        self,
        step_dir: Path,
        *,
        group: Any,
        manifest_fields: dict[str, Any],
        keep_last: int | None,
        update_latest: bool,
    ) -> None:
        self.step_dir = step_dir
        self.group = group
        self.manifest_fields = manifest_fields
        self.keep_last = keep_last
        self.update_latest = update_latest

    def __call__(self) -> None:
        rank, world = _rank(), _world()
        mine = _own_files(self.step_dir, rank)
        hashes = {name: sha256_file(self.step_dir / name) for name in mine}
        gathered: list[Any] = [None] * world if rank == 0 else []
        if self.group is not None:
            comm.gather_object(hashes, gathered if rank == 0 else None, dst=0, group=self.group)
        else:
            gathered = [hashes]
        error = None
        if rank == 0:
            try:
                self._complete(gathered)
            except Exception as e:  # reported to every rank below, so no rank waits forever
                error = f"{type(e).__name__}: {e}"
        if self.group is not None:
            box = [error]
            comm.broadcast_object_list(box, src=0, group=self.group)
            error = box[0]
        if error is not None:
            raise CheckpointError(f"{self.step_dir}: saving failed on rank 0: {error}")

    def _complete(self, gathered: list[dict[str, FileEntry]]) -> None:
        files: dict[str, FileEntry] = {}
        for part in gathered:
            files.update(part)
        for name in sorted(_data_files(self.step_dir)):
            if name not in files:
                files[name] = sha256_file(self.step_dir / name)
        manifest = Manifest(
            tag=self.step_dir.name,
            created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            files=dict(sorted(files.items())),
            **self.manifest_fields,
        )
        write_manifest(self.step_dir, manifest)
        layout.mark_complete(self.step_dir)
        root = self.step_dir.parent
        if self.update_latest:
            layout.write_latest(root, self.step_dir.name)
        if self.keep_last is not None:
            deleted = layout.apply_retention(root, keep_last=self.keep_last, protect=self.step_dir.name)
            if deleted:
                log.info("checkpoint retention removed %s", ", ".join(deleted))


def _data_files(step_dir: Path) -> list[str]:
    """Every file of a step directory that the manifest covers (all but the manifest, marker, temp files)."""
    skip = {layout.MANIFEST, layout.COMPLETE}
    return [
        p.name
        for p in step_dir.iterdir()
        if p.is_file() and p.name not in skip and not fnmatch.fnmatch(p.name, ".*.tmp*")
    ]


def _own_files(step_dir: Path, rank: int) -> list[str]:
    names = _data_files(step_dir)
    patterns = [f"__{rank}_*.distcp", rank_file(rank)] + (list(_RANK0_FILES) if rank == 0 else [])
    return [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]


class StepReader:
    """Reads a complete step directory into the current topology, verifying it first."""

    def __init__(self, step_dir: Path, *, group: Any = None) -> None:
        self.step_dir = Path(step_dir)
        self.group = group
        if not layout.is_complete(self.step_dir):
            raise CheckpointError(
                f"{self.step_dir}: no {layout.COMPLETE} marker; the save was interrupted, so it is not loaded"
            )
        self.manifest = read_manifest(self.step_dir)
        self._shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None

    def verify(self) -> None:
        """Check every file's size and sha256; the work is split over ranks, any failure raises on all."""
        rank, world = _rank(), _world()
        names = sorted(self.manifest.files)
        error = None
        try:
            verify_files(self.step_dir, self.manifest, names[rank::world])
        except CheckpointError as e:
            error = str(e)
        errors = [error]
        if world > 1:
            errors = [None] * world
            comm.all_gather_object(errors, error, group=self.group)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise CheckpointError(first)

    def saved_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Global shape and dtype of every tensor in the DCP metadata, by flattened key."""
        if self._shapes is None:
            self._shapes = self._read_shapes()
        return self._shapes

    def _read_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        try:
            metadata = FileSystemReader(os.fspath(self.step_dir)).read_metadata()
        except Exception as e:  # DCP raises plain exceptions for a damaged .metadata
            raise CheckpointError(f"{self.step_dir / '.metadata'}: unreadable ({e})") from e
        return {
            key: (tuple(md.size), md.properties.dtype)
            for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }

    def check_shapes(self, template: dict[str, Any], *, strict_prefixes: tuple[str, ...] = ("model.",)) -> None:
        """Compare the current state's global shapes with the saved ones before reading any tensor.

        Keys under `strict_prefixes` must match both ways (a missing or extra parameter is a different
        model); every other template tensor must exist in the checkpoint with the same shape.
        """
        saved = self.saved_shapes()
        wanted = {k: (tuple(t.shape), t.dtype) for k, t in flat_tensors(template).items()}
        problems = []
        for key, (shape, _) in wanted.items():
            if key not in saved:
                problems.append(f"{key} is not in the checkpoint")
            elif saved[key][0] != shape:
                problems.append(f"{key} has shape {list(saved[key][0])} in the checkpoint, {list(shape)} in the model")
        # A rank may hold only part of the model (expert parallelism: its own experts), so "in the
        # model" means held by some rank of the group.
        held = set(wanted)
        if comm.get_world_size(self.group) > 1:
            everyone: list[Any] = [None] * comm.get_world_size(self.group)
            comm.all_gather_object(everyone, sorted(k for k in wanted if k.startswith(strict_prefixes)),
                                   group=self.group)
            held = held.union(*map(set, everyone))
        extra = [k for k in saved if k.startswith(strict_prefixes) and k not in held]
        if "optim" in template and not any(k.startswith("optim.state.") for k in wanted):
            if any(k.startswith("optim.state.") for k in saved):
                problems.append(
                    "the optimizer has no state to load into (initialize it before loading, as "
                    "torch.distributed.checkpoint.state_dict.get_state_dict does)"
                )
        problems += [f"{k} is in the checkpoint but not in the model" for k in sorted(extra)]
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise CheckpointError(
                f"{self.step_dir / '.metadata'}: checkpoint does not fit the current model: "
                + "; ".join(problems[:3])
                + more
            )

    def load_tensors(self, template: dict[str, Any]) -> None:
        """Read the saved tensors into `template` in place, resharding to the current layout."""
        dcp.load(template, checkpoint_id=self.step_dir, process_group=self.group)

    def rank_state(self, rank: int) -> dict[str, Any] | None:
        """The per-rank state saved by `rank`, or None when the saving world had no such rank."""
        name = rank_file(rank)
        return load_small(self.step_dir / name) if name in self.manifest.files else None

    def shared_state(self) -> dict[str, Any]:
        """The rank-0 state (counters, scheduler, scaler, data position, client_state)."""
        return load_small(self.step_dir / ENGINE_STATE)
