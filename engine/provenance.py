"""Dataset fingerprints the training code reports, for the job's provenance record.

Callers: user training code (`deepfleet.engine.provenance.fingerprint(path)` or
`engine.record_dataset(uri=..., digest=...)`) and the worker's heartbeat sink, which reads
`reported()` and carries the fingerprints (and torch's version) to the controller in its heartbeats,
where they are appended to the job's provenance chain.

`fingerprint` hashes a file, a directory (every file under it, in sorted relative-path order, each
name and content fed to one sha256) or an iterable of bytes/str/tensors/nested sequences, with
hashlib: no library offers a stable digest over a directory tree or a sample stream.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20
_lock = threading.Lock()
_reported: dict[str, str] = {}


def _feed(h: Any, item: Any) -> None:
    if isinstance(item, (bytes, bytearray, memoryview)):
        h.update(b"b%d:" % len(item))
        h.update(item)
    elif isinstance(item, str):
        data = item.encode("utf-8")
        h.update(b"s%d:" % len(data))
        h.update(data)
    elif hasattr(item, "detach") and hasattr(item, "cpu"):  # a tensor, without importing torch here
        t = item.detach().cpu().contiguous()
        h.update(f"t{t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(item, dict):
        h.update(b"d%d:" % len(item))
        for key in sorted(item, key=str):
            _feed(h, str(key))
            _feed(h, item[key])
    elif isinstance(item, (list, tuple)):
        h.update(b"l%d:" % len(item))
        for part in item:
            _feed(h, part)
    elif isinstance(item, (int, float, bool)) or item is None:
        _feed(h, repr(item))
    else:
        raise TypeError(f"fingerprint: cannot hash a {type(item).__name__}; give bytes, str, tensors, "
                        "numbers or lists/dicts of them, or a file/directory path")


def fingerprint(source: str | os.PathLike[str] | Iterable[Any]) -> str:
    """"sha256:<hex>" of a file, a directory tree, or an iterable of samples (order matters)."""
    h = hashlib.sha256()
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_file():
            files = [(path.name, path)]
        elif path.is_dir():
            files = sorted((p.relative_to(path).as_posix(), p) for p in path.rglob("*") if p.is_file())
        else:
            raise FileNotFoundError(f"fingerprint: {path} is neither a file nor a directory; give the data's path")
        for rel, p in files:
            _feed(h, rel)
            h.update(b"f%d:" % p.stat().st_size)
            with p.open("rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
    else:
        for item in source:
            _feed(h, item)
    return "sha256:" + h.hexdigest()


def record_dataset(uri: str, digest: str | None = None) -> str:
    """Report the data source this run trains on: `uri` names it, `digest` is its fingerprint (computed
    with `fingerprint(uri)` when omitted and `uri` is a local path). Returns the digest."""
    if not uri:
        raise ValueError("record_dataset: uri is empty; name the data source (a path or URI)")
    if digest is None:
        digest = fingerprint(uri)
    with _lock:
        _reported[str(uri)] = digest
    return digest


def reported() -> list[dict[str, str]]:
    """Every dataset reported in this process so far: [{"uri", "digest"}], in uri order."""
    with _lock:
        return [{"uri": u, "digest": d} for u, d in sorted(_reported.items())]


def clear() -> None:
    """Forget the reported datasets (tests; a new run in the same process)."""
    with _lock:
        _reported.clear()


def model_metadata(chain: dict[str, Any]) -> dict[str, str]:
    """The safetensors metadata an exported model carries from its job's provenance (the document
    `GET /v1/jobs/{id}/provenance` answers and `deepfleet provenance JOB --json` prints): the job id,
    the chain's head hash and the records as canonical JSON."""
    try:
        job_id, records = str(chain["job_id"]), list(chain["records"])
    except (KeyError, TypeError):
        raise ValueError("provenance: expected the document `deepfleet provenance JOB --json` prints "
                         "(with job_id and records)") from None
    head = records[-1]["hash"] if records else ""
    return {"deepfleet.job_id": job_id, "deepfleet.provenance_head": head,
            "deepfleet.provenance": json.dumps(records, sort_keys=True, separators=(",", ":"), ensure_ascii=False)}
