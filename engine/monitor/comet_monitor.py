"""The `comet` monitor: a Comet ML experiment (an `OfflineExperiment` when `online` is false), metrics
logged every `samples_log_interval` samples against the global sample count. Built by
`base.build_monitors`; needs the comet_ml package (in the `monitor` extra), and says so in one line at
initialize when it is missing. Offline archives land in comet_ml's `COMET_OFFLINE_DIRECTORY`."""

from __future__ import annotations

from typing import Any

from deepfleet.engine.metrics import StepMetrics
from deepfleet.engine.monitor.base import require, scalars


class CometMonitor:
    def __init__(self, section: Any, config: Any) -> None:
        comet_ml = require("comet_ml", "comet")
        self.interval = section.samples_log_interval
        self._next = 0
        experiment_config = comet_ml.ExperimentConfig(name=section.experiment_name) if section.experiment_name \
            else None
        self.experiment = comet_ml.start(
            api_key=section.api_key, workspace=section.workspace, project=section.project,
            experiment_key=section.experiment_key, mode=section.mode, online=section.online,
            experiment_config=experiment_config,
        )

    def write(self, m: StepMetrics) -> None:
        if m.global_samples < self._next:
            return
        self._next = m.global_samples + self.interval
        self.experiment.log_metrics(scalars(m), step=m.global_samples)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """DeepSpeed's `monitor.write_events`: `(tag, value, step)` scalars from the training script."""
        for tag, value, step in events:
            self.experiment.log_metric(tag, value, step=step)

    def close(self) -> None:
        self.experiment.end()
