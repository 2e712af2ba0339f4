"""What every monitor shares: the scalars of a step, rank 0 only, and failures that never stop training.

Called by `engine/build.py` (`build_monitors`), which appends the monitors the config enables to the
engine's step sinks. Each monitor module (`tensorboard_monitor`, `csv_monitor`, `wandb_monitor`,
`mlflow_monitor`, `comet_monitor`) wraps one third-party writer and imports it only when enabled; a
missing package fails `initialize` with one line naming it. After that, a monitor that raises is
logged (with its name, once per distinct error) and skipped for that step; training goes on.

Metric names are DeepSpeed's ("Train/Samples/train_loss", "Train/Samples/lr", ...), logged against the
global sample count as DeepSpeed does; the step number, throughput and MFU come beside them.
"""

from __future__ import annotations

import logging
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
    """A monitor as a step sink: called on rank 0 only; its exceptions are logged, never raised."""

    def __init__(self, name: str, monitor: Any) -> None:
        self.name = name
        self.monitor = monitor
        self._reported: set[str] = set()

    def __call__(self, m: StepMetrics) -> None:
        self._guard(lambda: self.monitor.write(m))

    def close(self) -> None:
        self._guard(self.monitor.close)

    def _guard(self, call: Callable[[], None]) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - best effort: a report never stops training
            key = f"{type(e).__name__}: {e}"
            if key not in self._reported:
                self._reported.add(key)
                logger.warning("monitor %s failed (training goes on): %s", self.name, key)


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
