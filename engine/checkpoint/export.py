"""Export a sharded checkpoint's model weights to one consolidated safetensors file.

Callers: cli.py (`export DIR --out model.safetensors [--dtype bf16]`) and users' scripts. Runs in a
plain process (no process group, any machine that can read the checkpoint). Peak memory is bounded by
`budget_bytes`, not by the model: tensors are read from the DCP shards a batch at a time (DCP's
partial load, resharding each one to a full tensor) and appended to the output file, so the full model
is never held in memory, let alone twice.

Why the file is written here rather than with `safetensors.torch.save_file`: that function needs every
tensor in memory at once. The safetensors layout is simple and fully known up front from the DCP
metadata (names, dtypes, shapes): an 8-byte little-endian header length, a JSON header with each
tensor's dtype, shape and byte offsets, then the raw little-endian bytes in header order. The output
loads with plain `safetensors.torch.load_file`.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from deepfleet.engine.checkpoint.io import StepReader
from deepfleet.engine.checkpoint.layout import CheckpointError

MODEL_PREFIX = "model."
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ST_DTYPE = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class ExportReport:
    """What `export_safetensors` wrote."""

    path: Path
    tensors: int
    bytes: int
    peak_batch_bytes: int  # the largest batch of tensors held in memory at once


def export_safetensors(
    step_dir: str | Path,
    out: str | Path,
    *,
    dtype: str = "fp32",
    budget_bytes: int = 256 << 20,
    verify: bool = True,
    metadata: dict[str, str] | None = None,
) -> ExportReport:
    """Write the model weights of complete checkpoint `step_dir` to safetensors file `out`.

    Floating-point tensors are cast to `dtype` ("fp32", "bf16" or "fp16"); integer buffers keep theirs.
    Names are the model's FQNs (no "model." prefix). Raises CheckpointError for an incomplete,
    corrupted or model-less checkpoint and for an unknown dtype. `metadata` (string to string, e.g. the
    job's provenance from `deepfleet.controller.provenance.safetensors_metadata`) is added to the file's
    `__metadata__`.
    """
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise CheckpointError(f"metadata.{key}: safetensors metadata holds strings only; pass str values")
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype: {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    target = DTYPES[dtype]
    if sys.byteorder != "little":
        raise CheckpointError("safetensors export needs a little-endian machine")
    reader = StepReader(Path(step_dir))
    if verify:
        reader.verify()
    saved = {k: v for k, v in reader.saved_shapes().items() if k.startswith(MODEL_PREFIX)}
    if not saved:
        raise CheckpointError(f"{reader.step_dir}: holds no model tensors (keys under {MODEL_PREFIX!r})")

    # The header: every tensor's final dtype, shape and byte range, in name order.
    entries: list[tuple[str, str, tuple[int, ...], torch.dtype, torch.dtype]] = []
    header: dict[str, dict] = {"__metadata__": {**(metadata or {}), "format": "pt", "source": str(reader.step_dir)}}
    offset = 0
    for key in sorted(saved):
        shape, stored = saved[key]
        final = target if stored.is_floating_point else stored
        if final not in _ST_DTYPE:
            raise CheckpointError(f"{key}: dtype {stored} has no safetensors equivalent")
        nbytes = _numel(shape) * final.itemsize
        name = key[len(MODEL_PREFIX) :]
        header[name] = {"dtype": _ST_DTYPE[final], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        entries.append((key, name, shape, stored, final))
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the data section starts 8-byte aligned

    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    peak = 0
    try:
        with open(tmp, "wb") as f:
            f.write(len(header_bytes).to_bytes(8, "little"))
            f.write(header_bytes)
            for batch in _batches(entries, budget_bytes):
                tensors = {key: torch.empty(shape, dtype=stored) for key, _, shape, stored, _ in batch}
                peak = max(peak, sum(t.nbytes for t in tensors.values()))
                _load_partial(tensors, reader.step_dir)
                for key, _, _, _, final in batch:
                    t = tensors.pop(key).to(final).contiguous()
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return ExportReport(path=out, tensors=len(entries), bytes=out.stat().st_size, peak_batch_bytes=peak)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _batches(entries: list, budget_bytes: int) -> list[list]:
    """Consecutive groups of entries whose stored bytes stay under the budget (one tensor at least)."""
    batches: list[list] = []
    current: list = []
    size = 0
    for entry in entries:
        nbytes = _numel(entry[2]) * entry[3].itemsize
        if current and size + nbytes > budget_bytes:
            batches.append(current)
            current, size = [], 0
        current.append(entry)
        size += nbytes
    if current:
        batches.append(current)
    return batches


def _load_partial(tensors: dict[str, torch.Tensor], step_dir: Path) -> None:
    with warnings.catch_warnings():
        # Loading in one plain process is the intent here; DCP warns about it unconditionally.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(tensors, checkpoint_id=step_dir, no_dist=True)

