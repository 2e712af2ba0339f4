"""Indexed row files: the on-disk format of the data-efficiency index (`engine/data_sampling.py`).

A file pair `<prefix>.bin` / `<prefix>.idx` holds a list of one-dimensional integer rows of varying
length. It is the memory-mapped layout that Megatron-LM introduced and DeepSpeed's data analyzer writes,
so index files made by DeepSpeed's `DataAnalyzer` are read here as they are, and ours are readable by it:

- `.bin`: the rows' elements back to back, in the file's dtype.
- `.idx`: the 9-byte magic `MMIDIDX\\0\\0`, a little-endian u64 version (1), a u8 dtype code, u64 row
  count, u64 document count, then the rows' lengths (int32), their byte offsets into `.bin` (int64) and
  the document boundaries (int64; one document holding every row here).

Written here because neither torch nor numpy reads this format; rows are served as read-only numpy
views of one `np.memmap` (nothing is loaded until used). Torch-free.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

_MAGIC = b"MMIDIDX\x00\x00"
_VERSION = 1
# the dtype codes of the format (DeepSpeed's table)
_CODES: dict[int, type[np.integer]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.uint16, 7: np.uint32, 8: np.uint64,
}
_CODE_OF = {np.dtype(t): code for code, t in _CODES.items()}


def smallest_int_dtype(low: int, high: int) -> np.dtype:
    """The narrowest integer dtype of the format that holds every value in [low, high]."""
    for t in ((np.uint8, np.uint16, np.uint32, np.uint64) if low >= 0 else (np.int8, np.int16, np.int32, np.int64)):
        info = np.iinfo(t)
        if info.min <= low and high <= info.max:
            return np.dtype(t)
    raise ValueError(f"values {low}..{high} do not fit a 64-bit integer")


def _code(dtype: np.dtype | type) -> int:
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise ValueError(f"dtype: {dt} cannot be stored in an index file; use one of "
                         f"{', '.join(np.dtype(t).name for t in _CODES.values())}")
    return _CODE_OF[dt]


def write_rows(prefix: str | Path, rows: Iterable[Sequence[int] | np.ndarray], dtype: np.dtype | type) -> None:
    """Write `rows` (each a 1-D sequence of integers) to `<prefix>.bin` and `<prefix>.idx`, each file
    replaced atomically (a reader never sees half a file)."""
    prefix = str(prefix)
    code, dt = _code(dtype), np.dtype(dtype)
    sizes: list[int] = []
    bin_tmp, idx_tmp = f"{prefix}.bin.tmp{os.getpid()}", f"{prefix}.idx.tmp{os.getpid()}"
    with open(bin_tmp, "wb") as out:
        for row in rows:
            values = np.asarray(row)
            if values.ndim != 1:
                values = values.reshape(-1)
            if values.size and (values.min() < np.iinfo(dt).min or values.max() > np.iinfo(dt).max):
                raise ValueError(f"row {len(sizes)}: values {values.min()}..{values.max()} do not fit {dt}")
            out.write(values.astype(dt, copy=False).tobytes(order="C"))
            sizes.append(int(values.size))
    lengths = np.asarray(sizes, dtype=np.int32)
    offsets = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dt.itemsize, out=offsets[1:])
    documents = np.asarray([0, len(sizes)], dtype=np.int64)
    with open(idx_tmp, "wb") as out:
        out.write(_MAGIC)
        out.write(struct.pack("<Q", _VERSION))
        out.write(struct.pack("<B", code))
        out.write(struct.pack("<Q", len(sizes)))
        out.write(struct.pack("<Q", len(documents)))
        out.write(lengths.tobytes(order="C"))
        out.write(offsets.tobytes(order="C"))
        out.write(documents.tobytes(order="C"))
    os.replace(bin_tmp, f"{prefix}.bin")
    os.replace(idx_tmp, f"{prefix}.idx")


class IndexedRows(Sequence[np.ndarray]):
    """The rows of `<prefix>.bin`/`.idx`: `rows[i]` is a read-only numpy array (a view of the file)."""

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = str(prefix)
        idx, data = f"{self.prefix}.idx", f"{self.prefix}.bin"
        for path in (idx, data):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path}: no such index file; run the data analyzer first, or give the "
                                        "path prefix without .bin/.idx")
        with open(idx, "rb") as f:
            head = f.read(9 + 8 + 1 + 8 + 8)
        if len(head) < 34 or head[:9] != _MAGIC:
            raise ValueError(f"{idx}: not an index file (bad magic)")
        (version,) = struct.unpack("<Q", head[9:17])
        if version != _VERSION:
            raise ValueError(f"{idx}: index version {version}, this reader knows {_VERSION}")
        code = head[17]
        if code not in _CODES:
            raise ValueError(f"{idx}: unknown dtype code {code}")
        self.dtype = np.dtype(_CODES[code])
        count, documents = struct.unpack("<QQ", head[18:34])
        index = np.memmap(idx, mode="r", dtype=np.uint8)
        self.sizes = np.frombuffer(index, dtype=np.int32, count=count, offset=34)
        self._offsets = np.frombuffer(index, dtype=np.int64, count=count, offset=34 + 4 * count)
        self.doc_idx = np.frombuffer(index, dtype=np.int64, count=documents, offset=34 + 12 * count)
        self._data = np.memmap(data, mode="r", dtype=np.uint8) if os.path.getsize(data) else np.zeros(0, np.uint8)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        i %= len(self)
        return np.frombuffer(self._data, dtype=self.dtype, count=int(self.sizes[i]), offset=int(self._offsets[i]))
