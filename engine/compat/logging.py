"""DeepSpeed's logging helpers (`deepspeed.utils.logger`, `log_dist`, `print_json_dist`) for scripts
that log through them. `logger` is the engine's `deepfleet` logger (level INFO, one stream handler,
added once when first asked for); `log_dist` logs on the listed ranks, as DeepSpeed's does: `ranks`
names global ranks, `[-1]` means every rank, and with no ranks nothing is logged once a process group
exists (every rank logs before)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"


def _make_logger() -> logging.Logger:
    log = logging.getLogger("deepfleet")
    if not any(getattr(h, "_deepfleet_compat", False) for h in log.handlers):
        handler = logging.StreamHandler(stream=sys.stdout)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler._deepfleet_compat = True  # type: ignore[attr-defined]
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def __getattr__(name: str) -> Any:  # `logger` is built on first use, not at import
    if name == "logger":
        return _make_logger()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _should_log(ranks: list[int] | None) -> tuple[bool, int]:
    if not dist.is_initialized():
        return True, -1
    rank = dist.get_rank()
    ranks = list(ranks or [])
    return bool(ranks) and (ranks[0] == -1 or rank in ranks), rank


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` at `level` on the listed global ranks, prefixed `[Rank N]`."""
    ok, rank = _should_log(ranks)
    if ok:
        _make_logger().log(level, "[Rank %s] %s", rank, message, stacklevel=2)


def print_json_dist(message: dict, ranks: list[int] | None = None, path: str | None = None) -> None:
    """Write `message` (a dict) as JSON to `path` on the listed ranks, with the writer's rank added."""
    ok, rank = _should_log(ranks)
    if ok and path is not None:
        Path(path).write_text(json.dumps({**message, "rank": rank}))
