"""A job's provenance: what ran, from what code and data, and which attempt wrote which checkpoint,
kept as an append-only hash chain.

Callers: `controller.db.jobs` (the submit record, and the runtime/dataset/checkpoint records a
heartbeat brings), the reconciler (one attempt record per attempt, with the code identity), the API's
`GET /v1/jobs/{id}/provenance` and the CLI (an exported model carries the chain through
`deepfleet.engine.provenance.model_metadata`). Pure functions on
plain dicts: no database, no backend.

Every record's hash is sha256 of the canonical JSON (sorted keys, no whitespace, UTF-8) of its job id,
sequence number, kind, attempt, time, data and the previous record's hash; the first record's previous
hash is 64 zeros. `verify_chain` recomputes every hash and link, so an edited, removed or reordered
record is reported by its sequence number. hashlib and json do the work; the chain is a few lines and
no library keeps one over SQL rows.
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

GENESIS = "0" * 64
KINDS = ("submit", "attempt", "runtime", "dataset", "checkpoint", "registration")


def canonical_json(value: Any) -> str:
    """The one JSON text of `value` that every hash is taken over."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sha256_json(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


def record_hash(*, job_id: str, seq: int, kind: str, attempt: int | None, time: str, data: Mapping[str, Any],
                prev_hash: str) -> str:
    """The hash a record stores (`time` as ISO 8601 UTC text, as stored)."""
    return sha256_json({"job_id": job_id, "seq": seq, "kind": kind, "attempt": attempt, "time": time,
                        "data": data, "prev_hash": prev_hash})


def verify_chain(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Problems in a job's records (dicts with the stored fields, in seq order); [] when intact."""
    problems: list[str] = []
    prev = GENESIS
    for expected_seq, r in enumerate(records):
        if r["seq"] != expected_seq:
            problems.append(f"record {r['seq']}: expected sequence number {expected_seq} (a record is missing)")
        if r["prev_hash"] != prev:
            problems.append(f"record {r['seq']}: prev_hash does not match record {r['seq'] - 1}'s hash")
        actual = record_hash(job_id=r["job_id"], seq=r["seq"], kind=r["kind"], attempt=r["attempt"],
                             time=r["time"], data=r["data"], prev_hash=r["prev_hash"])
        if actual != r["hash"]:
            problems.append(f"record {r['seq']} ({r['kind']}): content does not match its hash (modified)")
        prev = r["hash"]
    return problems


@functools.cache
def deepfleet_version() -> str:
    """The installed package's version (read once: a metadata lookup scans the installed packages)."""
    try:
        return metadata.version("deepfleet")
    except metadata.PackageNotFoundError:
        return "unknown"


def image_identity(image: str | None) -> dict[str, Any]:
    """An image reference and its digest when the reference pins one (`name@sha256:...`)."""
    if not image:
        return {}
    _, at, digest = image.partition("@")
    return {"image": image, "image_digest": digest if at and digest.startswith("sha256:") else None}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def git_commit(path: Path) -> dict[str, Any]:
    """The commit of the repository holding `path` and whether its tree differs from it ({} outside one)."""
    folder = path if path.is_dir() else path.parent
    try:
        head = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=False)
        if head.returncode != 0:
            return {}
        dirty = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git_commit": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}


def _module_file(module: str, workdir: Path) -> Path | None:
    parts = module.split(".")
    for base in (workdir, *(Path(p) for p in __import__("sys").path if p)):
        candidate = base.joinpath(*parts)
        for path in (candidate.with_suffix(".py"), candidate / "__init__.py"):
            if path.is_file():
                return path
    return None


def local_code_identity(entrypoint: Mapping[str, Any], workdir: Path) -> dict[str, Any]:
    """A local run's code: the script's (or the factory module's) path, sha256 and git commit."""
    if "script" in entrypoint:
        path = Path(entrypoint["script"]).expanduser()
        path = path if path.is_absolute() else workdir / path
        found: Path | None = path if path.is_file() else None
        name = str(entrypoint["script"])
    else:
        name = str(entrypoint.get("factory", ""))
        found = _module_file(name.partition(":")[0], workdir)
    if found is None:
        return {"entrypoint": name, "file": None, "file_sha256": None}
    return {"entrypoint": name, "file": str(found.resolve()), "file_sha256": file_sha256(found),
            **git_commit(found)}


def normalized_engine_config(spec_document: Mapping[str, Any], world_size: int) -> dict[str, Any] | None:
    """The job's inline engine config with every default filled in (None when the job has none or names
    a file, which the server does not read)."""
    engine = (spec_document.get("spec") or {}).get("engine")
    if not isinstance(engine, dict):
        return None
    from deepfleet.engine.config import ConfigError, load_config

    try:
        return load_config(engine, world_size=world_size).to_dict()
    except ConfigError:
        return None

