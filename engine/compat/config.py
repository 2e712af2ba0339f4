"""`deepspeed.DeepSpeedConfig` (also `deepspeed.runtime.config.DeepSpeedConfig`): a parsed config with
DeepSpeed's attribute names, for scripts and integrations that read it before `initialize`.

It is the engine's own parse (`deepfleet.engine.config.load_config`, with the same errors), resolved
for the data-parallel size of the running process group (1 without one), and exposes the attributes
callers read: the batch triple, precision switches, the ZeRO stage and section, optimizer/scheduler
names and params, clipping, printing. `config` is the resolved `DeepFleetConfig` itself."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class DeepSpeedConfig:
    """`DeepSpeedConfig(config, mpu=None)`: `config` is a dict, a JSON/YAML path or a JSON string."""

    def __init__(self, config: Any, mpu: Any = None, mesh_device: Any = None) -> None:
        from deepfleet.engine.config import load_config

        if mpu is not None:
            raise ValueError("mpu: model-parallel units are not supported; drop the mpu argument")
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.config = load_config(config, world_size=world)
        self._param_dict = self.config.to_dict()
        c = self.config
        self.train_batch_size = c.train_batch_size
        self.train_micro_batch_size_per_gpu = c.train_micro_batch_size_per_gpu
        self.gradient_accumulation_steps = c.gradient_accumulation_steps
        self.steps_per_print = c.steps_per_print
        self.dump_state = c.dump_state
        self.gradient_clipping = c.gradient_clipping
        self.wall_clock_breakdown = c.wall_clock_breakdown
        self.fp16_enabled = bool(c.fp16.enabled)
        self.bfloat16_enabled = bool(c.bf16.enabled)
        self.zero_config = c.zero_optimization
        self.activation_checkpointing_config = c.activation_checkpointing
        self.zero_optimization_stage = int(c.zero_optimization.stage)
        self.zero_enabled = self.zero_optimization_stage > 0
        self.optimizer_name = c.optimizer.type.lower() if c.optimizer is not None else None
        self.optimizer_params = c.optimizer.params.model_dump() if c.optimizer is not None else None
        self.scheduler_name = c.scheduler.type if c.scheduler is not None else None
        self.scheduler_params = c.scheduler.params.model_dump() if c.scheduler is not None else None
        self.world_size = world

    def print(self, name: str) -> None:
        """Log the resolved config (DeepSpeed's `DeepSpeedConfig.print`)."""
        import json

        from deepfleet.engine.compat.logging import log_dist

        log_dist(f"{name}: {json.dumps(self._param_dict, sort_keys=True, default=str)}", ranks=[0])
