"""The engine's progress line: a `StepSink` that logs every `steps_per_print` optimizer steps on rank 0.

Composed first into the engine's sinks by `engine/build.py`; the engine formats no metric anywhere else.
The line carries the step, the loss (mean over the steps since the last line), the learning rates, the
gradient norm and loss scale of the step printed, the skipped-step count and the throughput over the
steps since the last line; with `wall_clock_breakdown` a second line gives the mean forward, backward
and optimizer-step time per step over the same steps.

A user running a plain script sees the line without configuring Python logging, as with DeepSpeed:
when nothing handles the record (no handler on the root logger or on the way to it), a fallback
handler writes it to stdout. As soon as the application configures logging (`logging.basicConfig`,
pytest's capture), the fallback stands aside and the record goes where the application sends it.
"""

from __future__ import annotations

import logging
import math
import sys

from deepfleet.engine.metrics import StepMetrics

logger = logging.getLogger(__name__)


class _Fallback(logging.Handler):
    """Writes to the current sys.stdout only while no other handler would receive the record."""

    def emit(self, record: logging.LogRecord) -> None:
        node: logging.Logger | None = logging.getLogger(record.name)
        while node is not None:
            if any(h is not self for h in node.handlers):
                return
            node = node.parent if node.propagate else None
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging's contract: a handler reports, never raises
            self.handleError(record)


def _install_fallback() -> None:
    if not any(isinstance(h, _Fallback) for h in logger.handlers):
        handler = _Fallback()
        handler.setFormatter(logging.Formatter("[deepfleet] %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:  # an explicit level set by the application wins
        logger.setLevel(logging.INFO)


class ProgressLog:
    """Every `every` steps (None: never), rank 0 logs one progress line (and the wall-clock breakdown)."""

    def __init__(self, every: int | None, *, wall_clock_breakdown: bool = False, rank: int = 0) -> None:
        self.every = every
        self.breakdown = wall_clock_breakdown
        self.active = rank == 0 and bool(every)
        if self.active:
            _install_fallback()
        self._window: list[StepMetrics] = []

    def __call__(self, m: StepMetrics) -> None:
        if not self.active:
            return
        self._window.append(m)
        if m.step % self.every != 0:
            return
        window, self._window = self._window, []
        losses = [w.loss for w in window if w.loss is not None]
        loss = sum(losses) / len(losses) if losses else math.nan
        elapsed = sum(w.elapsed_s for w in window)
        throughput = sum(w.samples for w in window) / elapsed if elapsed > 0 else math.nan
        logger.info(
            "step %d | loss %.4f | lr %s | grad_norm %.4f | loss_scale %g | skipped %d | %.1f samples/s",
            m.step, loss, ", ".join(f"{lr:.3e}" for lr in m.lrs),
            m.grad_norm if m.grad_norm is not None else math.nan, m.loss_scale, m.skipped_steps, throughput,
        )  # fmt: skip
        if self.breakdown:
            per_step = {k: 1000 * sum(w.timings.get(k, 0.0) for w in window) / len(window)
                        for k in ("forward", "backward", "step")}
            logger.info("time per step (ms) | forward %.1f | backward %.1f | optimizer step %.1f",
                        per_step["forward"], per_step["backward"], per_step["step"])
