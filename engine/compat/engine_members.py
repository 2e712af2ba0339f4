"""The members of DeepSpeed's engine that real scripts and integrations call, beyond the training
protocol (`DeepSpeedEngineMembers`, a mixin of `DeepFleetEngine`): ranks and device, precision and
ZeRO queries, `was_step_applied`, `set_gradient_accumulation_boundary`, `tput_timer`, `monitor`, and
attribute fall-through to the wrapped model (DeepSpeed's engine forwards unknown attributes to
`self.module`, so `engine.config_class` or `engine.generate(...)` reach the model)."""

from __future__ import annotations

import time
from typing import Any

import torch

from deepfleet.engine import comm


class ThroughputTimer:
    """`engine.tput_timer`: samples per second over the optimizer steps seen so far (DeepSpeed's
    `avg_samples_per_sec()`), fed by the engine's step records."""

    def __init__(self, batch_size: int, *, enabled: bool = True, synchronized: bool = True) -> None:
        self.batch_size = batch_size
        self.enabled, self.synchronized = enabled, synchronized  # the `timers.throughput` section
        self.global_step_count = 0
        self.total_elapsed_time = 0.0
        self._last: float | None = None

    def step_done(self, now: float | None = None) -> None:
        if not self.enabled:
            return
        if self.synchronized and now is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        now = time.perf_counter() if now is None else now
        if self._last is not None:
            self.total_elapsed_time += now - self._last
            self.global_step_count += 1
        self._last = now

    def avg_samples_per_sec(self) -> float:
        if self.global_step_count == 0 or self.total_elapsed_time <= 0:
            return 0.0
        return self.batch_size * self.global_step_count / self.total_elapsed_time


class _MonitorView:
    """`engine.monitor`: DeepSpeed's `MonitorMaster` surface (`enabled`, `write_events`) over the
    engine's monitor sinks (TensorBoard, W&B, CSV, Comet, MLflow)."""

    def __init__(self, sinks: list[Any]) -> None:
        # monitors run behind `Guarded` sinks (engine/monitor/base.py), on rank 0 only
        self._guarded = [s for s in sinks if hasattr(getattr(s, "monitor", None), "write_events")]

    @property
    def enabled(self) -> bool:
        return bool(self._guarded)

    def write_events(self, event_list: list[tuple[str, float, int]]) -> None:
        """Write `(name, value, step)` events to every enabled monitor, now; a failing monitor is logged,
        never raised (as for the engine's own metrics)."""
        events = [(str(n), float(v), int(s)) for n, v, s in event_list]
        for sink in self._guarded:
            sink.flush()  # the engine's queued records first, so files stay in step order
            sink._guard(lambda sink=sink: sink.monitor.write_events(events))


class DeepSpeedEngineMembers:
    """Mixed into `DeepFleetEngine`; reads the engine's `config`, `parallel`, `precision`, `module`."""

    _step_applied = False
    _forced_boundary: bool | None = None

    @property
    def local_rank(self) -> int:
        import os

        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return comm.get_rank()

    @property
    def world_size(self) -> int:
        """The data-parallel size (what DeepSpeed's `engine.world_size` means: the batch is split over it)."""
        return self.parallel.dp_size

    @property
    def dp_world_size(self) -> int:
        return self.parallel.dp_size

    @property
    def device(self) -> torch.device:
        from deepfleet.engine.dist import training_device

        return training_device()

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_stage(self) -> int:
        return int(self.config.zero_optimization.stage)

    def zero_offload_optimizer(self) -> bool:
        offload = getattr(self.config.zero_optimization, "offload_optimizer", None)
        return offload is not None and getattr(offload, "device", "none") not in (None, "none")

    def gradient_clipping(self) -> float:
        return float(self.config.gradient_clipping)

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def was_step_applied(self) -> bool:
        """Whether the last `step()` updated the weights (False off the boundary and on fp16 overflow)."""
        return self._step_applied

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Force the next micro-steps to be (or not be) the accumulation boundary, regardless of the
        micro-step count (DeepSpeed's manual override, used by pipeline-style loops)."""
        self._forced_boundary = bool(is_boundary)

    def get_global_step(self) -> int:
        return self.global_steps

    # progressive layer drop and the legacy curriculum (engine/curriculum.py), DeepSpeed's accessors
    @property
    def progressive_layer_drop(self) -> Any:
        return self.model_schedules.progressive_layer_drop

    @property
    def curriculum_scheduler_legacy(self) -> Any:
        return self.model_schedules.curriculum

    def get_pld_theta(self) -> float | None:
        pld = self.model_schedules.progressive_layer_drop
        return pld.get_theta() if pld is not None else None

    def curriculum_enabled_legacy(self) -> bool:
        return self.model_schedules.curriculum is not None

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Any) -> None:
        """`{metric: fn(step) -> difficulty}` for the data-sampling curriculum's custom metrics; for the legacy
        curriculum, a plain function (or a one-entry dict) sets its custom difficulty function."""
        loader = self.training_dataloader
        if self.curriculum_learning_enabled() and loader is not None and hasattr(loader, "data_sampler"):
            if not isinstance(schedule_func_dict, dict):
                raise ValueError("set_custom_curriculum_learning_schedule: give {metric_name: function} for "
                                 "data_efficiency.data_sampling.curriculum_learning")
            loader.data_sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)
            return
        fn = next(iter(schedule_func_dict.values())) if isinstance(schedule_func_dict, dict) else schedule_func_dict
        if self.model_schedules.curriculum is None:
            raise ValueError("curriculum_learning: not enabled; set curriculum_learning.enabled and schedule_type custom "
                             "(or data_efficiency.data_sampling.curriculum_learning with training_data)")
        self.model_schedules.curriculum.set_custom_get_difficulty(fn)

    # the data-sampling curriculum (engine/data_sampling.py), DeepSpeed's accessors
    def data_sampling_enabled(self) -> bool:
        de = self.config.data_efficiency
        return bool(de.enabled and de.data_sampling.enabled)

    def data_sampling_config(self) -> Any:
        return self.config.data_efficiency.data_sampling

    def curriculum_learning_enabled(self) -> bool:
        return self.config.data_efficiency.data_curriculum() is not None

    def curriculum_learning_config(self) -> Any:
        return self.config.data_efficiency.data_sampling.curriculum_learning

    def set_data_post_process_func(self, post_process_func: Any) -> None:
        """Called as `fn(batch, sampler_state)` on each batch of the curriculum loader (DeepSpeed's hook)."""
        loader = self.training_dataloader
        if loader is None or not hasattr(loader, "post_process_func"):
            raise ValueError("set_data_post_process_func: needs the curriculum loader; enable "
                             "data_efficiency.data_sampling.curriculum_learning and pass training_data to initialize")
        loader.post_process_func = post_process_func

    @property
    def tput_timer(self) -> ThroughputTimer:
        timer = self.__dict__.get("_tput_timer")
        if timer is None:
            settings = self.config.timers.throughput
            timer = ThroughputTimer(self.config.train_batch_size, enabled=settings.enabled,
                                    synchronized=settings.synchronized)
            self.__dict__["_tput_timer"] = timer
        return timer

    @property
    def monitor(self) -> _MonitorView:
        return _MonitorView(self.sinks)

    def __getattr__(self, name: str) -> Any:
        # nn.Module.__getattr__ finds parameters, buffers and submodules; then the wrapped model's attributes
        try:
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            if name.startswith("__") or name == "module":
                raise
            modules = self.__dict__.get("_modules", {})
            if "module" in modules:
                return getattr(modules["module"], name)
            raise
