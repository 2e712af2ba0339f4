"""The `comms_logger` section: per collective count, bytes, latency, algorithmic and bus bandwidth.

A step sink composed by `engine/build.py` when `comms_logger.enabled`. It reads
`deepfleet.engine.comm.counters()` (always-on counters: two clock reads per op, no device
synchronisation; see comm.py) at each step and keeps per-op totals since the engine was built.
Summaries are logged every `steps_per_print` steps and when the engine is closed (`engine.destroy()`,
or at interpreter exit), on rank 0 (every rank with `debug`); `verbose` adds each step's per-op deltas.

Bandwidth, as NCCL's tests define it over n ranks (n: the world size; the counters do not keep a group
per op, and the engine's collectives run over the data-parallel group, which is the world unless
another degree is set): algorithmic bandwidth = message size / latency, where the message is the
buffer an op produces (an all-gather's output, n x this rank's input; a reduce-scatter's or
all-reduce's input); bus bandwidth = algbw x the share of it each link carries: 2(n-1)/n for
all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for broadcast and point to point.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from deepfleet.engine import comm
from deepfleet.engine.metrics import StepMetrics

logger = logging.getLogger(__name__)


def _message_factor(name: str, n: int) -> float:
    """Message size / this rank's counted input bytes."""
    return float(n) if name.startswith("all_gather") else 1.0


def bus_factor(name: str, n: int) -> float:
    if n <= 1:
        return 0.0
    if name.startswith("all_reduce"):
        return 2 * (n - 1) / n
    if name.startswith(("all_gather", "reduce_scatter_", "all_to_all")):
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True)
class OpSummary:
    """One op's totals over the run on this rank."""

    name: str
    count: int
    bytes: int
    seconds: float
    world_size: int

    @property
    def latency_s(self) -> float:
        return self.seconds / self.count if self.count else 0.0

    @property
    def algbw(self) -> float:
        """Bytes per second of the message (see the module docstring)."""
        if self.seconds <= 0:
            return 0.0
        return self.bytes * _message_factor(self.name, self.world_size) / self.seconds

    @property
    def busbw(self) -> float:
        return self.algbw * bus_factor(self.name, self.world_size)


class CommsLogger:
    """Per-op totals since the engine was built, logged as a table every `steps_per_print` steps."""

    def __init__(self, section: Any, *, steps_per_print: int | None, rank: int, world_size: int) -> None:
        self.section = section
        self.every = steps_per_print
        self.rank, self.world_size = rank, world_size
        self.active = rank == 0 or section.debug
        self._start = comm.counters()
        self._last = self._start

    def _selected(self, name: str) -> bool:
        return self.section.prof_all or name in self.section.prof_ops

    def summary(self) -> list[OpSummary]:
        """Per-op totals since the engine was built (the ops `prof_all`/`prof_ops` select)."""
        now = comm.counters()
        rows = []
        for name, c in sorted(now.items()):
            base = self._start.get(name)
            count = c.count - (base.count if base else 0)
            if count and self._selected(name):
                rows.append(OpSummary(name, count, c.bytes - (base.bytes if base else 0),
                                      c.seconds - (base.seconds if base else 0.0), self.world_size))
        return rows

    def __call__(self, m: StepMetrics) -> None:
        if self.section.verbose and self.active:
            now = comm.counters()
            for name, c in sorted(now.items()):
                last = self._last.get(name)
                count = c.count - (last.count if last else 0)
                if count and self._selected(name):
                    logger.info("comm step %d rank %d | %s | count %d | %d bytes | %.3f ms", m.step, self.rank,
                                name, count, c.bytes - (last.bytes if last else 0),
                                1000 * (c.seconds - (last.seconds if last else 0.0)))
            self._last = now
        if self.every and m.step % self.every == 0:
            self.log_summary(f"after step {m.step}")

    def log_summary(self, when: str = "end of training") -> None:
        if not self.active:
            return
        rows = self.summary()
        logger.info("comms summary, rank %d, %s (%d ranks):\n%s", self.rank, when, self.world_size, format_table(rows))

    def close(self) -> None:
        self.log_summary()


def format_table(rows: list[OpSummary]) -> str:
    header = f"{'op':<26}{'count':>8}{'total MB':>12}{'avg latency ms':>16}{'algbw GB/s':>12}{'busbw GB/s':>12}"
    lines = [header]
    for r in rows:
        lines.append(f"{r.name:<26}{r.count:>8}{r.bytes / 1e6:>12.3f}{r.latency_s * 1e3:>16.3f}"
                     f"{r.algbw / 1e9:>12.3f}{r.busbw / 1e9:>12.3f}")
    return "\n".join(lines)
