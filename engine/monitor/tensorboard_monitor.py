"""The `tensorboard` monitor: scalar events under `<output_path>/<job_name>/`, through torch's
`SummaryWriter` (the tensorboard package writes the event files). Built by `base.build_monitors`."""

from __future__ import annotations

import os
from typing import Any

from deepfleet.engine.metrics import StepMetrics
from deepfleet.engine.monitor.base import require, scalars


class TensorBoardMonitor:
    def __init__(self, section: Any, config: Any) -> None:
        require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(section.output_path or ".", section.job_name)
        self.writer = SummaryWriter(log_dir=self.log_dir)
        self.flush_every = config.steps_per_print or 0

    def write(self, m: StepMetrics) -> None:
        for tag, value in scalars(m).items():
            self.writer.add_scalar(tag, value, m.global_samples)
        if self.flush_every and m.step % self.flush_every == 0:
            self.writer.flush()

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """DeepSpeed's `monitor.write_events`: `(tag, value, step)` scalars from the training script."""
        for tag, value, step in events:
            self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self.writer.close()
