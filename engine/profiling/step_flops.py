"""The engine's side of the FLOPs profiler: count one training step, report it, and give every later
step its FLOPs, MFU and HFU.

Built by `engine/build.py` from the `flops_profiler` section; the engine wraps each forward and backward
in `counting(phase)` and hands every step's `StepMetrics` to `figures(m)`. Only the accumulation window
of step `profile_step` runs under FlopCounterMode (it slows the ops it sees); the FLOPs it counts are
this rank's, and later steps scale them by their token count (or keep them, with no token count).

Model FLOPs (MFU's numerator) are the forward and backward counted in the window minus the forward
share that activation checkpointing recomputes (`recompute_fwd_factor` x forward FLOPs, which
FlopCounterMode counts inside backward); hardware FLOPs (HFU's) keep it. MFU = model FLOPs /
(step seconds x this rank's peak FLOP/s, `peaks.py`); the step's seconds are its wall clock, so time
spent outside compute (communication, data loading) lowers MFU, as it should.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from deepfleet.engine.metrics import StepMetrics
from deepfleet.engine.profiling.flops_profiler import FlopsProfiler
from deepfleet.engine.profiling.peaks import peak_flops

logger = logging.getLogger(__name__)


class StepFlops:
    """FLOPs, MFU and HFU of each step, from the one profiled step."""

    def __init__(self, model: nn.Module, config: Any, *, rank: int, peak: float | None) -> None:
        self.config = config  # the flops_profiler section
        self.rank = rank
        self.peak = peak
        self._profiler = FlopsProfiler(model, recompute_fwd_factor=config.recompute_fwd_factor)
        self._measuring = False
        self._phase: dict[str, int] = {"forward": 0, "backward": 0}
        self.model_flops: float | None = None  # of the profiled step, this rank
        self.hardware_flops: float | None = None
        self._tokens: int | None = None

    @classmethod
    def build(cls, model: nn.Module, config: Any, *, rank: int, dtype: torch.dtype) -> StepFlops | None:
        section = config.flops_profiler
        if not section.enabled:
            return None
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        return cls(model, section, rank=rank, peak=peak_flops(device, dtype))

    def counting(self, step: int, phase: str):
        """Context for one forward or backward of the window ending in optimizer step `step`."""
        if step != self.config.profile_step:
            return nullcontext()
        return self._count(phase)

    @contextmanager
    def _count(self, phase: str) -> Iterator[None]:
        if not self._measuring:
            self._profiler.reset_profile()
            self._measuring = True
        counts = self._profiler.counts
        before = counts.total
        timed = phase == "forward"  # module latencies are of the forward, as in DeepSpeed's report
        if timed:
            self._profiler.attach_hooks()
        try:
            with counts.count(phase):
                yield
        finally:
            if timed:
                self._profiler.detach_hooks()
            self._phase[phase] += counts.total - before

    def figures(self, m: StepMetrics) -> dict[str, float | None]:
        """The step's flops, mfu and hfu (None before the profiled step)."""
        if self._measuring and m.step == self.config.profile_step:
            self._finish_profile(m)
        if self.model_flops is None:
            return {"flops": None, "mfu": None, "hfu": None}
        scale = m.tokens / self._tokens if m.tokens and self._tokens else 1.0
        flops, hardware = self.model_flops * scale, self.hardware_flops * scale
        if not self.peak or m.elapsed_s <= 0:
            return {"flops": flops, "mfu": None, "hfu": None}
        capacity = m.elapsed_s * self.peak
        return {"flops": flops, "mfu": flops / capacity, "hfu": hardware / capacity}

    def _finish_profile(self, m: StepMetrics) -> None:
        self._measuring = False
        fwd, bwd = self._phase["forward"], self._phase["backward"]
        self.hardware_flops = float(fwd + bwd)
        self.model_flops = float(fwd + bwd - self.config.recompute_fwd_factor * fwd)
        self._tokens = m.tokens
        if self.rank == 0:
            c = self.config
            self._profiler.print_model_profile(profile_step=m.step, module_depth=c.module_depth,
                                               top_modules=c.top_modules, detailed=c.detailed,
                                               output_file=c.output_file)
            logger.info("flops profiler: step %d forward %.4g FLOPs, backward %.4g FLOPs, peak %s FLOP/s per rank",
                        m.step, fwd, bwd, f"{self.peak:.4g}" if self.peak else "unknown")
        self._profiler.end_profile()
