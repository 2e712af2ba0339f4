"""The `csv_monitor` monitor: one CSV file per metric under `<output_path>/<job_name>/`, named after
the metric with "/" as "_" (`Train_Samples_train_loss.csv`), rows "step,<metric>" where step is the
global sample count, as DeepSpeed writes them. Built by `base.build_monitors`. Plain `csv` module: no
package needed."""

from __future__ import annotations

import csv
import os
from typing import Any, TextIO

from deepfleet.engine.metrics import StepMetrics
from deepfleet.engine.monitor.base import scalars


class CSVMonitor:
    def __init__(self, section: Any, config: Any) -> None:
        self.folder = os.path.join(section.output_path or ".", section.job_name)
        os.makedirs(self.folder, exist_ok=True)
        self._files: dict[str, tuple[TextIO, Any]] = {}

    def path(self, tag: str) -> str:
        return os.path.join(self.folder, tag.replace("/", "_") + ".csv")

    def write(self, m: StepMetrics) -> None:
        self.write_events([(tag, value, m.global_samples) for tag, value in scalars(m).items()])

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """Rows `step,value` per tag (also DeepSpeed's `monitor.write_events` from training scripts)."""
        for tag, value, step in events:
            entry = self._files.get(tag)
            if entry is None:
                path = self.path(tag)
                new = not os.path.exists(path) or os.path.getsize(path) == 0
                f = open(path, "a", newline="")  # noqa: SIM115 - kept open for the run, closed in close()
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", tag.rsplit("/", 1)[-1]])
                entry = self._files[tag] = (f, writer)
            f, writer = entry
            writer.writerow([step, value])
            f.flush()

    def close(self) -> None:
        for f, _ in self._files.values():
            f.close()
        self._files.clear()
