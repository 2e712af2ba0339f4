"""Export a succeeded job's model: node 0 writes the newest complete checkpoint's weights to one
safetensors file and an `export.json` manifest beside it, for the controller to register.

Caller: `worker/agent.py` (`run`, in the worker process of node 0, after every training process of the
attempt exited 0 and only when the WorkerSpec has `export`). The weights are read with
`deepfleet.engine.checkpoint.export.export_safetensors` (streaming, any world size the checkpoint was
saved at); the file's metadata names the job, the attempt and the checkpoint. The controller adds the
job's provenance chain when it registers the file (it holds the chain; the worker does not).

An export that fails leaves training's result alone: the worker still exits 0, and the manifest holds
the error, which the controller records as the registration's failure (the job stays SUCCEEDED).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from deepfleet.worker.spec import EXPORT_MANIFEST, EXPORT_MODEL_FILE, ExportManifest, WorkerSpec

_CHUNK = 1 << 20


def export_model(spec: WorkerSpec) -> ExportManifest | None:
    """Export the newest complete checkpoint of `spec.checkpoint.dir` into `spec.export_dir` and write the
    manifest; returns it (None when the spec asks for no export). Never raises for a checkpoint problem:
    the manifest then carries the error."""
    out = spec.export_dir
    if out is None or spec.export is None or spec.checkpoint is None:
        return None
    from deepfleet.engine.checkpoint.export import export_safetensors
    from deepfleet.engine.checkpoint.layout import CheckpointError, find_latest_complete, list_steps

    ids = {"job_id": spec.job_id, "attempt": spec.attempt}
    root = Path(spec.checkpoint.dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        tag = find_latest_complete(root) if root.is_dir() else None
        if tag is None:
            raise CheckpointError(f"{root} holds no complete checkpoint to export; the training code must save one "
                                  "(the managed loop does at the end)")
        metadata = {"deepfleet.job_id": spec.job_id, "deepfleet.attempt": str(spec.attempt),
                    "deepfleet.checkpoint": tag}
        report = export_safetensors(root / tag, out / EXPORT_MODEL_FILE, dtype=spec.export.dtype, metadata=metadata)
        manifest = ExportManifest(**ids, file=EXPORT_MODEL_FILE, checkpoint=tag,
                                  global_steps=next((i.global_steps for i in list_steps(root) if i.tag == tag), None),
                                  dtype=spec.export.dtype, tensors=report.tensors, bytes=report.bytes,
                                  sha256=file_sha256(report.path))
        print(f"deepfleet-worker: exported {report.tensors} tensors of checkpoint {tag} to {report.path} "
              f"({report.bytes} bytes)", file=sys.stderr, flush=True)
    except (CheckpointError, OSError) as e:
        manifest = ExportManifest(**ids, error=f"{type(e).__name__}: {e}"[:4000])
        print(f"deepfleet-worker: model export failed: {manifest.error}", file=sys.stderr, flush=True)
    try:
        _write_atomically(out / EXPORT_MANIFEST, manifest.model_dump_json(exclude_none=True).encode())
    except OSError as e:
        print(f"deepfleet-worker: cannot write {out / EXPORT_MANIFEST}: {e}", file=sys.stderr, flush=True)
    return manifest


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
