"""The `mlflow` monitor (DeepSpeed has none): one MLflow run of the job, logged through `MlflowClient`
(no global active run, so a user's own `mlflow.start_run()` is untouched). Tracking store: the
section's `tracking_uri`, else MLFLOW_TRACKING_URI, else a local SQLite file `./mlruns.db` (MLflow 3
refuses new plain-folder stores; the SQLite file is the local store it supports). Built by
`base.build_monitors`. Metric names drop DeepSpeed's "Train/Samples/" prefix ("train_loss", "lr", ...)
because MLflow's UI groups by name, and the step is the global sample count."""

from __future__ import annotations

import os
import time
from typing import Any

from deepfleet.engine.metrics import StepMetrics
from deepfleet.engine.monitor.base import require, scalars

DEFAULT_TRACKING_URI = "sqlite:///mlruns.db"


class MLflowMonitor:
    def __init__(self, section: Any, config: Any) -> None:
        require("mlflow", "mlflow")
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self._metric = Metric
        uri = section.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(section.experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(section.experiment_name))
        self.run_id = self.client.create_run(experiment_id, run_name=section.run_name).info.run_id

    def write(self, m: StepMetrics) -> None:
        self.write_many([m])

    def write_many(self, batch: list[StepMetrics]) -> None:
        """One `log_batch` per 1000 metrics (MLflow's limit per call)."""
        now = int(time.time() * 1000)
        metrics = [self._metric(tag.rsplit("/", 1)[-1], value, now, m.global_samples)
                   for m in batch for tag, value in scalars(m).items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """DeepSpeed's `monitor.write_events`: `(tag, value, step)` scalars from the training script."""
        now = int(time.time() * 1000)
        metrics = [self._metric(tag.rsplit("/", 1)[-1], value, now, step) for tag, value, step in events]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
