"""File I/O shared by the ZeRO-Infinity NVMe offloads: optimizer state (`engine/zero/nvme.py`) and
stage-3 parameter shards (`engine/zero/nvme_param.py`).

Why hand-written: torch has no asynchronous file tier for tensors (`torch.save`/`from_file` are
synchronous and whole-tensor), and DeepSpeed's async-I/O op is a C++ extension we do not build on. The
I/O here is plain `os.pread`/`os.pwrite` on `aio.block_size` requests, `aio.thread_count` threads
issuing a file's requests (`aio.queue_depth` in flight per thread; `single_submit` issues them one at
a time; `overlap_events` submits a new request as each one completes, instead of batch by batch).

Safety: a file is written to `<name>.tmp`, fsynced and renamed over `<name>`, so a file that exists
under its final name is always complete (`BlockIO.write_file`). `check_nvme_path` checks an offload
directory before anything is written: one line naming the config key and the fix.
"""

from __future__ import annotations

import ctypes
import os
import shutil
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

ALIGN = 64  # byte alignment of each tensor inside an offload file


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def check_nvme_path(path: str | None, needed_bytes: int, *, key: str, what: str) -> Path:
    """The offload directory, or a one-line ValueError naming `key` and the fix (`what` needs the room:
    "the optimizer state", "the parameter shards")."""
    if not path:
        raise ValueError(f"{key}: required with device \"nvme\"; set it to a writable directory on a fast disk")
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{key}: {path} does not exist; create the directory or point nvme_path at one")
    if not p.is_dir():
        raise ValueError(f"{key}: {path} is not a directory; point nvme_path at a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(f"{key}: {path} is not writable by this process; fix its permissions or use another directory")
    free = shutil.disk_usage(p).free
    if free < needed_bytes:
        raise ValueError(
            f"{key}: {path} has {free / 2**20:.1f} MiB free but {what} needs "
            f"{needed_bytes / 2**20:.1f} MiB; free space there or point nvme_path at a larger disk"
        )
    return p


def job_name() -> str:
    """The job's name in offload directory names (`<job>-rank<r>`): the platform's job id, else "local"."""
    return os.environ.get("DEEPFLEET_JOB_ID") or os.environ.get("DEEPFLEET_JOB_NAME") or "local"


def clear_directory(directory: Path) -> None:
    """Create `directory` and delete the files in it: offload files are never trusted across engines (a
    new engine's state comes from memory or a checkpoint), which also drops a killed run's `.tmp`s."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.iterdir():
        if stale.is_file():
            stale.unlink()


def storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    """A writable byte view of a host storage's memory (no copy: reads land in the storage itself). It
    is valid while the storage lives and is not resized."""
    n = storage.nbytes()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(storage.data_ptr())).cast("B")


class BlockIO:
    """Reads and writes whole files in `aio.block_size` requests over `aio.thread_count` threads.

    `key` names the config key in error messages (a short read)."""

    def __init__(self, aio: Any, *, key: str) -> None:
        self.key = key
        self.block = max(4096, int(aio.block_size))
        self.queue_depth = max(1, int(aio.queue_depth))
        self.single_submit = bool(aio.single_submit)
        self.overlap_events = bool(aio.overlap_events)
        self.threads = max(1, int(aio.thread_count))
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="nvme-io")
        self.bytes_read = 0
        self.bytes_written = 0

    def transfer(self, fd: int, view: memoryview, offset: int, *, write: bool) -> None:
        """`view` to/from the file at `offset` in `aio.block_size` requests over the I/O threads."""
        spans = [(o, min(self.block, len(view) - o)) for o in range(0, len(view), self.block)]

        def run(o: int, n: int) -> None:
            if write:
                done = 0
                while done < n:
                    done += os.pwrite(fd, view[o + done:o + n], offset + o + done)
            else:
                got = os.preadv(fd, [view[o:o + n]], offset + o)
                if got != n:
                    raise OSError(f"{self.key}: short read from an offload file ({got} of {n} bytes)")

        if self.single_submit or len(spans) == 1:
            for o, n in spans:
                run(o, n)
            return
        window = self.queue_depth * self.threads
        if self.overlap_events:  # a new request is submitted as soon as one completes
            in_flight: set[Future] = set()
            for o, n in spans:
                if len(in_flight) >= window:
                    done, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
                    for f in done:
                        f.result()
                in_flight.add(self._pool.submit(run, o, n))
            for f in in_flight:
                f.result()
            return
        for start in range(0, len(spans), window):  # submit a batch, wait for all of it, then the next
            for f in [self._pool.submit(run, o, n) for o, n in spans[start:start + window]]:
                f.result()

    def write_file(self, final: Path, parts: list[tuple[int, memoryview]], *, size: int | None = None) -> None:
        """Write `(offset, bytes)` parts to `final` atomically: `<final>.tmp`, fsync, rename. A failure
        leaves at most the `.tmp`, never a partial file under the final name. `size`: the file's length
        (alignment gaps and the tail read as zeros)."""
        tmp = final.with_name(final.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if size is not None:
                os.ftruncate(fd, size)
            for offset, view in parts:
                self.transfer(fd, view, offset, write=True)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)  # complete under its final name, or not there at all
        self.bytes_written += sum(len(v) for _, v in parts)

    def read_file(self, path: Path, parts: list[tuple[int, memoryview]]) -> None:
        """Fill each `(offset, bytes)` part from `path`."""
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset, view in parts:
                self.transfer(fd, view, offset, write=False)
        finally:
            os.close(fd)
        self.bytes_read += sum(len(v) for _, v in parts)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
