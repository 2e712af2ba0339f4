"""`wall_clock_breakdown`: where the wall time of training goes, as shares of the step time.

A step sink composed by `engine/build.py` when `wall_clock_breakdown` is true (the progress line keeps
its per-phase milliseconds). Phases come from each `StepMetrics` (forward, backward, step, checkpoint:
seconds inside the engine's calls); communication is the seconds the comm counters add over the step (it
happens inside backward and step, so it is shown as its own row and as "of which" of those two);
data loading is the engine's own "data" timing (fetching batches from the loader `initialize` built),
and "other" the rest of the time between the engine's calls (the user's loop). Where the engine does
not own the loader, all the time between its calls counts as data loading. Logged on rank 0 every `steps_per_print` steps and at the end.
"""

from __future__ import annotations

import logging

from deepfleet.engine import comm
from deepfleet.engine.metrics import StepMetrics

logger = logging.getLogger(__name__)

PHASES = ("forward", "backward", "step", "checkpoint", "communication", "data_loading", "other")
INSIDE = ("forward", "backward", "step", "checkpoint")  # phases timed inside the engine's calls


def _comm_seconds() -> float:
    return sum(c.seconds for c in comm.counters().values())


class WallClockBreakdown:
    """Seconds per phase summed over the run, and their shares of the total step wall time."""

    def __init__(self, *, steps_per_print: int | None, rank: int) -> None:
        self.every = steps_per_print
        self.active = rank == 0
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.wall = 0.0
        self._comm = _comm_seconds()

    def __call__(self, m: StepMetrics) -> None:
        now = _comm_seconds()
        inside = sum(m.timings.get(k, 0.0) for k in INSIDE)
        for k in INSIDE:
            self.totals[k] += m.timings.get(k, 0.0)
        self.totals["communication"] += now - self._comm
        between = max(0.0, m.elapsed_s - inside)  # time between the engine's calls
        fetched = min(m.timings.get("data", between), between)
        self.totals["data_loading"] += fetched
        self.totals["other"] += between - fetched
        self.wall += m.elapsed_s
        self._comm = now
        if self.every and m.step % self.every == 0:
            self.log(f"after step {m.step}")

    def shares(self) -> dict[str, float]:
        """Each phase's share of the wall time (communication overlaps backward and step)."""
        return {k: (v / self.wall if self.wall > 0 else 0.0) for k, v in self.totals.items()}

    def table(self) -> str:
        lines = [f"{'phase':<16}{'seconds':>10}{'share':>8}"]
        for k, share in self.shares().items():
            label = "  communication" if k == "communication" else k
            lines.append(f"{label:<16}{self.totals[k]:>10.3f}{100 * share:>7.1f}%")
        lines.append(f"{'wall':<16}{self.wall:>10.3f}{100.0:>7.1f}%")
        return "\n".join(lines)

    def log(self, when: str = "end of training") -> None:
        if self.active:
            logger.info("wall clock breakdown, %s:\n%s", when, self.table())

    def close(self) -> None:
        self.log()
