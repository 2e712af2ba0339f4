"""The step seam: one `StepMetrics` record per optimizer step, handed to a list of `StepSink`s.

`engine/engine.py` measures each step once (`StepRecorder`) and emits the record from `_take_model_step`;
`engine/build.py` composes the sinks (the progress log line of `engine/progress.py`, then any named by
`DEEPFLEET_STEP_SINKS`). Consumers: the progress log, the worker's heartbeat and managed loop
(`deepfleet.worker.heartbeat`, `deepfleet.worker.train`), and later the monitors, the profiler and the
autotuner. No consumer recomputes a metric: each reads the record and aggregates over its own window.

`DEEPFLEET_STEP_SINKS` holds comma-separated "module:factory" entries. Each factory is imported by name
when the engine is built and called with no arguments; it returns a sink, or None to opt out (e.g. a
rank that must not post). This is how the worker's heartbeat reaches a plain user script without the
engine importing the worker (the import contract forbids it; a run-time import by name is not an
import edge).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from deepfleet.engine import comm

SINKS_ENV = "DEEPFLEET_STEP_SINKS"


@dataclass(frozen=True)
class StepMetrics:
    """What one optimizer step did, as measured on this rank (the same record reaches every sink)."""

    step: int
    """`global_steps` after this step (skipped fp16 steps count, as in DeepSpeed)."""
    rank: int
    """This process's global rank; sinks that report once per job act on rank 0 only."""
    loss: float | None
    """Mean of this rank's unscaled micro-batch losses in the accumulation window (None if backward
    was never called with a loss)."""
    lr: float
    """Learning rate of the first param group after the step (what `engine.get_lr()[0]` returns)."""
    lrs: tuple[float, ...]
    """Every param group's learning rate after the step."""
    grad_norm: float | None
    """Pre-clip global gradient L2 norm (`engine.get_global_grad_norm()`)."""
    loss_scale: float
    """The fp16 loss scale after this step's update (1.0 for bf16/fp32)."""
    skipped: bool
    """True when the optimizer step was skipped (fp16 overflow)."""
    skipped_steps: int
    """Steps skipped so far in this run, this one included."""
    samples: int
    """Samples in this step over all data-parallel ranks (`train_batch_size`)."""
    global_samples: int
    """Samples consumed since the start of training (restored with a checkpoint)."""
    tokens: int | None
    """Tokens in this step over all data-parallel ranks: this rank's micro-batch tokens (the elements of
    an integer `input_ids` tensor, else of the first integer tensor input) times the data-parallel size,
    because every rank gets micro-batches of the same shape from the engine's loader. None when the
    inputs hold no integer tensor."""
    elapsed_s: float
    """Wall-clock seconds since the previous step ended (or since the engine was built)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase summed over the window's micro-steps: "forward", "backward", "step"
    (gradient reduction, clipping, optimizer and publishing), "data" (fetching the window's batches from
    the engine's own data loader, present when `initialize` got `training_data`), and "checkpoint" when
    `save_checkpoint` ran since the previous step."""
    comm_bytes: int = 0
    """Bytes this rank sent through `deepfleet.engine.comm` during the step (its forward, backward and
    optimizer phases, every micro-step): the difference of `comm.counters()` over the step."""
    peak_model_state_bytes: int | None = None
    """High-water mark of this rank's model-state bytes over the step (`deepfleet.engine.memory`);
    None until the strategy reports it."""
    flops: float | None = None
    """Model FLOPs of this step on this rank (forward + backward, `engine/profiling/step_flops.py`); None
    unless `flops_profiler` is enabled and its `profile_step` has been reached."""
    mfu: float | None = None
    """Model FLOPs utilization: `flops` / (elapsed_s x this rank's peak FLOP/s); None when unknown."""
    hfu: float | None = None
    block_eigenvalues: tuple[float, ...] | None = None
    """Each block's dominant loss-Hessian eigenvalue from this step's boundary micro-batch, averaged over
    the data-parallel group (`eigenvalue` section, engine/eigenvalue.py); None on steps it was not due."""
    """Hardware FLOPs utilization: as `mfu`, counting activation recomputation too."""
    comm_compressed: bool | None = None
    """Whether the gradient reductions are compressed (`communication` section; False after the guard fell
    back); None without a compression policy."""
    comm_compression_error: float | None = None
    """On guard steps: the largest ||compressed - exact|| / ||exact|| over the step's reductions."""
    comm_loss_delta: float | None = None
    """On guard steps: the relative change of the rank-averaged loss since the previous guard step."""
    dp_epsilon: float | None = None
    """Epsilon spent so far under DP-SGD (`deepfleet_differential_privacy`, engine/privacy.py) at `dp_delta`; None
    without it."""
    dp_delta: float | None = None
    """The delta of `dp_epsilon`."""
    dp_accountant: str | None = None
    """The privacy accountant that computed `dp_epsilon` ("rdp" or "prv")."""


@runtime_checkable
class StepSink(Protocol):
    """Anything called once per optimizer step with that step's record. A sink must not raise for
    reasons of its own (an unreachable endpoint, a full disk): training does not stop for a report."""

    def __call__(self, m: StepMetrics) -> None: ...


def count_tokens(args: tuple, kwargs: Mapping[str, Any]) -> int | None:
    """Token count of one micro-batch: the elements of an integer `input_ids` tensor (in kwargs or in a
    mapping argument), else of the first integer tensor found; None if there is none."""
    candidates: list[Any] = [kwargs.get("input_ids")]
    candidates += [a.get("input_ids") for a in args if isinstance(a, Mapping)]
    candidates += list(args) + list(kwargs.values())
    candidates += [v for a in args if isinstance(a, Mapping) for v in a.values()]
    for c in candidates:
        if isinstance(c, torch.Tensor) and not c.is_floating_point() and not c.is_complex() and c.dtype != torch.bool:
            return c.numel()
    return None


def sinks_from_env(environ: Mapping[str, str] | None = None) -> list[StepSink]:
    """The sinks named by `DEEPFLEET_STEP_SINKS` ("module:factory", comma-separated), built now.

    Raises ValueError naming the entry when one cannot be imported or is not a callable factory."""
    env = os.environ if environ is None else environ
    sinks: list[StepSink] = []
    for entry in (e.strip() for e in env.get(SINKS_ENV, "").split(",")):
        if not entry:
            continue
        factory = _factory(entry)
        sink = factory()
        if sink is None:
            continue
        if not callable(sink):
            raise ValueError(f"{SINKS_ENV}: {entry} returned {type(sink).__name__}, not a callable sink; "
                             "return a function of one StepMetrics (or None to opt out)")
        sinks.append(sink)
    return sinks


def _factory(entry: str) -> Callable[[], StepSink | None]:
    module_name, sep, attr = entry.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{SINKS_ENV}: {entry!r} is not \"module:factory\"; write e.g. "
                         "deepfleet.worker.heartbeat:step_sink")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{SINKS_ENV}: cannot import {module_name!r} ({e}); install it or fix the entry") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{SINKS_ENV}: {module_name!r} has no {attr!r}; name a factory defined there")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{SINKS_ENV}: {entry} is not callable; name a factory function")
    return obj


def _comm_bytes_sent() -> int:
    """Bytes this rank has sent through the comm module so far (every collective the engine issues)."""
    return sum(c.bytes for c in comm.counters().values())


class StepRecorder:
    """Measures one accumulation window as the engine sequences it, then turns it into a StepMetrics.

    The engine calls `micro_batch` in forward, `add_loss` in backward, `timed(phase)` around each phase
    and `finish(...)` at the end of the optimizer step, which also starts the next window."""

    def __init__(self, *, rank: int, dp_size: int, clock: Callable[[], float]) -> None:
        self.rank, self.dp_size, self._clock = rank, dp_size, clock
        self._window_start = clock()
        self._comm_start = _comm_bytes_sent()
        self._reset()

    def _reset(self) -> None:
        self._losses: list[torch.Tensor] = []
        self._tokens: int | None = None
        self.timings: dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0}

    def micro_batch(self, args: tuple, kwargs: Mapping[str, Any]) -> None:
        n = count_tokens(args, kwargs)
        if n is not None:
            self._tokens = (self._tokens or 0) + n

    def add_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach())

    def timed(self, phase: str) -> _Timed:
        return _Timed(self, phase)

    def finish(self, **fields: Any) -> StepMetrics:
        """The window's record; `fields` are the StepMetrics fields the engine owns (step, lr, lrs,
        grad_norm, loss_scale, skipped, skipped_steps, samples, global_samples, peak_model_state_bytes)."""
        now = self._clock()
        comm_now = _comm_bytes_sent()
        loss = float(torch.stack([x.float() for x in self._losses]).mean()) if self._losses else None
        metrics = StepMetrics(
            rank=self.rank,
            loss=loss,
            tokens=None if self._tokens is None else self._tokens * self.dp_size,
            elapsed_s=now - self._window_start,
            timings=dict(self.timings),
            comm_bytes=comm_now - self._comm_start,
            **fields,
        )
        self._window_start, self._comm_start = now, comm_now
        self._reset()
        return metrics


class _Timed:
    """Context manager adding the time spent inside it to one phase of the recorder's window."""

    def __init__(self, recorder: StepRecorder, phase: str) -> None:
        self._recorder, self._phase = recorder, phase

    def __enter__(self) -> None:
        self._start = self._recorder._clock()

    def __exit__(self, *exc: object) -> None:
        timings = self._recorder.timings
        timings[self._phase] = timings.get(self._phase, 0.0) + self._recorder._clock() - self._start
