"""What every monitor shares: the scalars of a step, rank 0 only, and failures that never stop training.

Called by `engine/build.py` (`build_monitors`), which appends the monitors the config enables to the
engine's step sinks. Each monitor module (`tensorboard_monitor`, `csv_monitor`, `wandb_monitor`,
`mlflow_monitor`, `comet_monitor`) wraps one third-party writer and imports it only when enabled; a
missing package fails `initialize` with one line naming it. After that, a monitor that raises is
logged (with its name, once per distinct error) and skipped for that step; training goes on. Monitors
write from a background thread in batches (`Guarded`), so the step pays a queue append only.

Metric names are DeepSpeed's ("Train/Samples/train_loss", "Train/Samples/lr", ...), logged against the
global sample count as DeepSpeed does; the step number, throughput and MFU come beside them.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from deepfleet.engine.metrics import StepMetrics

logger = logging.getLogger(__name__)

# config section -> "module:factory"; each factory takes (section, job config) and returns a Monitor.
MONITORS: dict[str, str] = {
    "tensorboard": "deepfleet.engine.monitor.tensorboard_monitor:TensorBoardMonitor",
    "csv_monitor": "deepfleet.engine.monitor.csv_monitor:CSVMonitor",
    "wandb": "deepfleet.engine.monitor.wandb_monitor:WandbMonitor",
    "mlflow": "deepfleet.engine.monitor.mlflow_monitor:MLflowMonitor",
    "comet": "deepfleet.engine.monitor.comet_monitor:CometMonitor",
}


def scalars(m: StepMetrics) -> dict[str, float]:
    """The step's scalars under DeepSpeed's names (None-valued metrics are left out)."""
    values: dict[str, float | None] = {
        "Train/Samples/train_loss": m.loss,
        "Train/Samples/lr": m.lr,
        "Train/Samples/loss_scale": m.loss_scale,
        "Train/Samples/grad_norm": m.grad_norm,
        "Train/Samples/samples_per_sec": m.samples / m.elapsed_s if m.elapsed_s > 0 else None,
        "Train/Samples/tokens_per_sec": m.tokens / m.elapsed_s if m.tokens and m.elapsed_s > 0 else None,
        "Train/Samples/mfu": m.mfu,
        "Train/Samples/step": float(m.step),
    }
    return {k: float(v) for k, v in values.items() if v is not None}


class MissingPackage(ValueError):
    """A monitor is enabled but its package is not installed (a config problem: initialize fails)."""


def require(package: str, section: str) -> Any:
    """Import a monitor's package, or fail with one line naming it and the fix."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise MissingPackage(
            f"{section}.enabled: needs the {package} package, which is not installed; "
            f"pip install 'deepfleet[monitor]' (or {package}), or set {section}.enabled to false"
        ) from None


class Guarded:
    """A monitor as a step sink, off the training thread: a call appends the record to a queue and
    returns; a daemon thread hands everything queued to `monitor.write_many` every `flush_s` seconds
    (one MLflow `log_batch` for many steps instead of one per step: MLflow's SQLite store takes ~80 ms a
    call, a 183 ms step on the example GPT). Exceptions are logged once per distinct error, never
    raised. `close()` writes what is queued, then closes the monitor. Rank 0 only (build_monitors)."""

    def __init__(self, name: str, monitor: Any, *, flush_s: float = 2.0, max_queue: int = 100_000) -> None:
        self.name = name
        self.monitor = monitor
        self.flush_s = flush_s
        self.dropped = 0
        self._queue: collections.deque[StepMetrics] = collections.deque(maxlen=max_queue)
        self._cond = threading.Condition()
        self._closed = False
        self._writing = False
        self._reported: set[str] = set()
        self._thread = threading.Thread(target=self._run, name=f"deepfleet-monitor-{name}", daemon=True)
        self._thread.start()

    def __call__(self, m: StepMetrics) -> None:
        with self._cond:
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
            self._queue.append(m)

    def flush(self) -> None:
        """Write everything queued now (blocks until the writer thread has)."""
        with self._cond:
            self._cond.notify_all()
            while self._queue or self._writing:
                self._cond.wait(timeout=0.05)
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self._guard(self.monitor.close)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._closed:
                    self._cond.wait(timeout=self.flush_s)
                batch = list(self._queue)
                self._queue.clear()
                self._writing = bool(batch)
                closed = self._closed
            if batch:
                self._guard(lambda batch=batch: write_many(self.monitor, batch))
            with self._cond:
                self._writing = False
                self._cond.notify_all()
            if closed:
                return

    def _guard(self, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - best effort: a report never stops training
            key = f"{type(e).__name__}: {e}"
            if key not in self._reported:
                self._reported.add(key)
                logger.warning("monitor %s failed (training goes on): %s", self.name, key)


def write_many(monitor: Any, batch: list[StepMetrics]) -> None:
    """The monitor's batch write when it has one, else one write per record."""
    many = getattr(monitor, "write_many", None)
    if many is not None:
        many(batch)
        return
    for m in batch:
        monitor.write(m)


def build_monitors(config: Any, *, rank: int) -> list[Guarded]:
    """The enabled monitors, on rank 0 (other ranks get none)."""
    if rank != 0:
        return []
    import importlib

    sinks = []
    for section_name, target in MONITORS.items():
        section = getattr(config, section_name)
        if not section.enabled:
            continue
        module, cls = target.split(":")
        factory = getattr(importlib.import_module(module), cls)
        try:
            monitor = factory(section, config)
        except MissingPackage:
            raise
        except Exception as e:  # noqa: BLE001 - an unreachable store or a full disk: train without it
            logger.warning("monitor %s could not start (training goes on without it): %s: %s",
                           section_name, type(e).__name__, e)
            continue
        sinks.append(Guarded(section_name, monitor))
    return sinks
