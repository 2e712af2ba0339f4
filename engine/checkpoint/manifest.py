"""The manifest of one checkpoint step: what wrote it, and the size and sha256 of every file in it.

Written by rank 0 once every rank has finished writing and reported the checksums of its own files
(io.py), read before any load (api.py, cli.py). A manifest of a newer format version than this code
understands, a missing file, a size or checksum mismatch all raise CheckpointError naming the file,
so a damaged checkpoint is never loaded partially. Torch-free: hashing is hashlib over 1 MiB blocks.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from deepfleet.engine.checkpoint.layout import FORMAT_VERSION, MANIFEST, CheckpointError, atomic_write

_BLOCK = 1 << 20


class FileEntry(BaseModel):
    """Size and content hash of one file of a step directory."""

    model_config = ConfigDict(extra="forbid")

    bytes: int
    sha256: str


class Manifest(BaseModel):
    """What a step directory holds and the topology that wrote it (loads reshard to any other)."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = FORMAT_VERSION
    tag: str
    global_steps: int
    micro_steps: int
    world_size: int
    degrees: dict[str, int] | None = None
    """The parallelism degrees that wrote it (engine.parallel.degrees(): pp, dp_replicate, dp_shard, ep,
    sp, tp, world_size); None in checkpoints written before degrees were recorded. Loads reshard to
    any data-parallel size."""
    tp_fused: list[str] | None = None
    """Tensor-parallel parameters saved in the share order of their tp degree (fused weights such as a
    qkv split per sub-block), so they resume at that degree only; None in checkpoints written before
    they were recorded."""
    zero_stage: int | None
    config_hash: str | None
    deepfleet_version: str
    torch_version: str
    created_at: str  # ISO 8601, UTC
    async_save: bool = False
    files: dict[str, FileEntry]  # relative file name -> entry

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())


def sha256_file(path: Path) -> FileEntry:
    """Hash `path` in 1 MiB blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
            size += len(block)
    return FileEntry(bytes=size, sha256=h.hexdigest())


def write_manifest(step_dir: Path, manifest: Manifest) -> None:
    """Write `<step_dir>/manifest.json` atomically."""
    atomic_write(Path(step_dir) / MANIFEST, manifest.model_dump_json(indent=2).encode())


def read_manifest(step_dir: Path) -> Manifest:
    """Parse `<step_dir>/manifest.json`; CheckpointError if it is missing, unreadable or too new."""
    path = Path(step_dir) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the save did not finish (no manifest)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable manifest ({e})") from e
    version = raw.get("format_version") if isinstance(raw, dict) else None
    if not isinstance(version, int):
        raise CheckpointError(f"{path}: format_version is missing or not an integer")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {version} is newer than this deepfleet understands "
            f"(<= {FORMAT_VERSION}); upgrade deepfleet to load it"
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CheckpointError(f"{path}: {where}: {first['msg']}") from e


def verify_files(step_dir: Path, manifest: Manifest, names: list[str] | None = None) -> None:
    """Check that each listed file (default: all) exists with the recorded size and sha256."""
    step_dir = Path(step_dir)
    for name in manifest.files if names is None else names:
        expected = manifest.files[name]
        path = step_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in the manifest but missing")
        size = path.stat().st_size
        if size != expected.bytes:
            raise CheckpointError(f"{path}: size {size} bytes, manifest says {expected.bytes}; the file is damaged")
        actual = sha256_file(path)
        if actual.sha256 != expected.sha256:
            raise CheckpointError(
                f"{path}: sha256 {actual.sha256[:16]}... does not match the manifest "
                f"({expected.sha256[:16]}...); the file is corrupted"
            )
