"""Reading job logs for GET /v1/jobs/{id}/logs: the seam to the backends, and the file fallback.

Called by the jobs router. The served controller (`controller/server.py`) gives `create_app` a
`LogReader`: a function over the reconciler's own backend objects that calls `Backend.logs()` (local
files, Kubernetes pod logs, Azure ML job logs). The API never imports a backend (an import-linter
contract); it only knows this callable and `LogUnavailable`, which the reader raises in place of the
backends' own errors. A bare API app (tests, an API-only replica) has no reader and reads the local
layout, `<logs_dir>/<run name>/node-<i>.log`, through a `LogLocator`; that tail is read backwards in
blocks, so a large log costs only what is returned.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Protocol

LogLocator = Callable[[str, int], Path]
"""(run name, node index) -> path of that node's log file."""


class LogUnavailable(LookupError):
    """The run has no such log (yet), or its backend is not served here; the message says which."""


class LogReader(Protocol):
    """Lines of one node's log of one run on `backend` (the last `tail` if set); with `follow`, keep
    yielding until the run ends. Raises `LogUnavailable`, possibly on the first iteration."""

    def __call__(self, backend: str, run_name: str, *, node: int, tail: int | None,
                 follow: bool) -> Iterator[str]: ...

BLOCK = 64 * 1024


def file_log_locator(logs_dir: Path) -> LogLocator:
    """The default layout: `<logs_dir>/<run name>/node-<i>.log`."""

    def locate(run_name: str, node: int) -> Path:
        return logs_dir / run_name / f"node-{node}.log"

    return locate


def tail_bytes(path: Path, *, lines: int | None, max_bytes: int) -> tuple[bytes, int]:
    """The last `lines` lines (all when None) of `path`, at most `max_bytes`; and the file size read up to."""
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        if lines is None:
            start = max(0, size - max_bytes)
            f.seek(start)
            return f.read(size - start), size
        # Walk back block by block until enough newlines are seen (one more: the last line may end in one).
        pos, chunks, newlines = size, [], 0
        while pos > 0 and newlines <= lines and size - pos < max_bytes:
            step = min(BLOCK, pos)
            pos -= step
            f.seek(pos)
            chunk = f.read(step)
            chunks.append(chunk)
            newlines += chunk.count(b"\n")
        data = b"".join(reversed(chunks))
    body = data[:-1] if data.endswith(b"\n") else data
    keep = body.split(b"\n")[-lines:] if lines > 0 else []
    out = b"\n".join(keep) + (b"\n" if keep and data.endswith(b"\n") else b"")
    return out[-max_bytes:], size


async def follow(
    path: Path, *, offset: int, finished: Callable[[], Awaitable[bool]],
    poll_s: float = 0.5, check_every: int = 4,
) -> AsyncIterator[bytes]:
    """Yield bytes appended to `path` after `offset` until `finished()` says the run is over and the
    file has been read to its end. The file may not exist yet (the run has not started)."""
    polls = 0
    while True:
        if path.exists():
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            if data:
                offset += len(data)
                yield data
                continue
        polls += 1
        if polls % check_every == 0 and await finished():
            # One last read: the run may have written its final lines just before it finished.
            if path.exists():
                with path.open("rb") as f:
                    f.seek(offset)
                    rest = f.read()
                if rest:
                    yield rest
            return
        await asyncio.sleep(poll_s)
