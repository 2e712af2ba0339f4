"""The `wandb` monitor: one Weights & Biases run, offline (files under `./wandb/`, or WANDB_DIR) unless
WANDB_MODE asks for "online", so a job never needs the network to train. Built by
`base.build_monitors`; `team` is W&B's entity, `group` the run group."""

from __future__ import annotations

import os
from typing import Any

from deepfleet.engine.metrics import StepMetrics
from deepfleet.engine.monitor.base import require, scalars


class WandbMonitor:
    def __init__(self, section: Any, config: Any) -> None:
        wandb = require("wandb", "wandb")
        self.run = wandb.init(
            project=section.project, group=section.group, entity=section.team,
            mode=os.environ.get("WANDB_MODE", "offline"), config=config.to_dict(), reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )

    def write(self, m: StepMetrics) -> None:
        self.run.log(scalars(m), step=m.global_samples)

    def write_events(self, events: list[tuple[str, float, int]]) -> None:
        """DeepSpeed's `monitor.write_events`: `(tag, value, step)` scalars from the training script."""
        for tag, value, step in events:
            self.run.log({tag: value}, step=step)

    def close(self) -> None:
        self.run.finish()
