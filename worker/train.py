"""The managed training loop, for jobs whose entrypoint is a factory instead of a script.

Caller: `worker/agent.py` (`child_main`, in every training process). The factory
(`entrypoint.factory`, "pkg.mod:function", called with `entrypoint.args` as keyword arguments) returns a `ManagedJob`:
the model, the training data set and optionally a loss function. The loop builds the engine with
`deepfleet.engine.initialize`, resumes from the newest *complete* checkpoint under `checkpoint.dir`
(model, optimizer, LR schedule, data position and RNG, at any world size), trains to `max_steps`
optimizer steps (a `PipelineModule` through `engine.train_batch`), checkpoints every `checkpoint.every_steps` and at the end, posts heartbeats from rank
0 (a `HeartbeatSink` on the engine's step seam), and on a preemption notice checkpoints at the next
step boundary and exits 75.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import os
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepfleet.engine.checkpoint.layout import find_latest_complete
from deepfleet.worker.heartbeat import HeartbeatReporter, HeartbeatSink
from deepfleet.worker.signals import PreemptionWatcher, exit_preempted, mark_preempted
from deepfleet.worker.spec import (
    FACTORY_MODULES_ENV,
    FactoryEntrypoint,
    WorkerSpec,
    WorkerSpecError,
)

_LIB_KEYS = ("stdlib", "platstdlib", "purelib", "platlib")


@dataclass
class ManagedJob:
    """What a factory returns. The engine calls `model(batch)`; with `loss_fn` the loss is
    `loss_fn(model(batch), batch)`, without it `model(batch)` must return the scalar loss."""

    model: torch.nn.Module
    training_data: torch.utils.data.Dataset
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    config: dict[str, Any] | str | None = None  # used when the spec has no engine_config


def _check_factory_origin(module_name: str) -> None:
    """A factory is the job's own code: its module's file must lie outside the interpreter's library
    directories (standard library, site-packages), unless its prefix is in DEEPFLEET_FACTORY_MODULES
    (set by the controller from the admin's allow-list). Raises WorkerSpecError, ModuleNotFoundError."""
    allowed = [p for p in os.environ.get(FACTORY_MODULES_ENV, "").split(",") if p]
    if any(module_name == p or module_name.startswith(p + ".") for p in allowed):
        return
    found = importlib.util.find_spec(module_name.split(".")[0])
    if found is None:
        raise ModuleNotFoundError(f"No module named {module_name.split('.')[0]!r}")
    origins = [found.origin] if found.origin and found.origin not in ("built-in", "frozen") else []
    origins += list(found.submodule_search_locations or [])
    libs = {os.path.realpath(p) for k, p in sysconfig.get_paths().items() if k in _LIB_KEYS}
    for origin in origins or ["<built-in>"]:
        real = os.path.realpath(origin)
        if origin == "<built-in>" or any(real == lib or real.startswith(lib + os.sep) for lib in libs):
            raise WorkerSpecError([f"entrypoint.factory: {module_name!r} is not the job's own code (it comes "
                                   "from the Python installation); name a function of your project's code"])


def build_job(entry: FactoryEntrypoint) -> ManagedJob:
    """Import and call the factory; accept a ManagedJob or a mapping with the same keys."""
    job = import_factory(entry)(**entry.args)
    if isinstance(job, Mapping):
        job = ManagedJob(**job)
    if not isinstance(job, ManagedJob):
        raise TypeError(f"{entry.factory} returned {type(job).__name__}; return a ManagedJob (or a dict with "
                        "model, training_data and optionally loss_fn, collate_fn, config)")
    return job


def import_factory(entry: FactoryEntrypoint) -> Callable[..., Any]:
    """The factory's function, imported under the job's-own-code rule (`_check_factory_origin`); raises
    WorkerSpecError naming entrypoint.factory."""
    module_name, _, attr = entry.factory.partition(":")
    try:
        _check_factory_origin(module_name)
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise WorkerSpecError([f"entrypoint.factory: cannot import {module_name!r} ({e}); put the package on "
                               "PYTHONPATH or run the worker from the directory that holds it"]) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise WorkerSpecError([f"entrypoint.factory: {module_name!r} has no {attr!r}; name a function "
                                   "defined in that module"])
        obj = getattr(obj, part)
    return obj


def _autotuned(spec: WorkerSpec, config: Any) -> Any:
    """The engine config to train with: `config` itself, or, when its `autotuning` section is enabled, the
    winner of tuning on the job's own ranks (`engine/planner/tune.py` `tune_job`; an earlier attempt's
    winner in results_dir is reused). A config that does not parse is returned as it is, for
    `initialize` to report."""
    from deepfleet.engine.config import ConfigError, load_config
    from deepfleet.engine.config_source import read_source

    data = read_source(config, [])
    try:
        enabled = data is not None and load_config(data, world_size=dist.get_world_size()).autotuning.enabled
    except ConfigError:
        return config
    if not enabled:
        return config
    from deepfleet.engine.planner.profile import build
    from deepfleet.engine.planner.tune import tune_job

    assert isinstance(spec.entrypoint, FactoryEntrypoint)
    rank = dist.get_rank()
    _log(rank, "autotuning: tuning the engine config before training")
    tuned = tune_job(data, lambda: build(lambda: build_job(spec.entrypoint), device="cpu"),
                     model_factory=spec.entrypoint.factory, world_size=dist.get_world_size(), write=rank == 0)
    zero = tuned.get("zero_optimization", {})
    _log(rank, f"autotuning: training with ZeRO stage {zero.get('stage', 0)}, micro-batch "
               f"{tuned['train_micro_batch_size_per_gpu']}, accumulation {tuned.get('gradient_accumulation_steps', 1)}")
    return tuned


def _batches(loader: Any) -> Iterator[Any]:
    while True:  # one pass per epoch, from the loader's saved position
        yield from loader


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[deepfleet] {message}", flush=True)


def _leave_group() -> None:
    # Tear the process groups down before the interpreter exits: a gloo group (ours, or the checkpoint
    # writer's) left to process exit can abort it ("terminate called without an active exception").
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def run_managed(spec: WorkerSpec) -> None:
    """Train `spec`'s factory job to `spec.max_steps`; returns normally when done, exits 75 when preempted."""
    import deepfleet.engine as engine_api

    assert isinstance(spec.entrypoint, FactoryEntrypoint) and spec.max_steps is not None
    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    engine_api.init_distributed(timeout=datetime.timedelta(seconds=spec.rendezvous.pg_timeout_s))
    job = build_job(spec.entrypoint)
    config = spec.engine_config if spec.engine_config is not None else job.config
    if config is None:
        raise WorkerSpecError(["engine_config: not set and the factory gave none; set engine_config to a "
                               "DeepSpeed-style dict or path"])
    config = _autotuned(spec, config)
    engine, _, loader, _ = engine_api.initialize(model=job.model, config=config, training_data=job.training_data,
                                                 collate_fn=job.collate_fn)
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    ckpt_dir = Path(spec.checkpoint.dir) if spec.checkpoint else None
    last_ckpt: str | None = None
    if ckpt_dir is not None:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        path, _ = engine.load_checkpoint(ckpt_dir)
        last_ckpt = Path(path).name if path else None
    _log(rank, f"job {spec.job_id} attempt {spec.attempt} restart {restart}: world size {world}, "
               f"starting at step {engine.global_steps}/{spec.max_steps}"
               + (f" from checkpoint {last_ckpt}" if last_ckpt else ""))

    def save() -> None:
        nonlocal last_ckpt
        if ckpt_dir is None:
            return
        engine.save_checkpoint(ckpt_dir, keep_last=spec.checkpoint.keep_last if spec.checkpoint else None)
        last_ckpt = find_latest_complete(ckpt_dir)

    # Heartbeats and the progress line read the engine's StepMetrics (the step seam); nothing is
    # measured here.
    reporter = HeartbeatReporter(spec.heartbeat if rank == 0 else spec.heartbeat.model_copy(update={"url": None}))
    heartbeat = HeartbeatSink(reporter.start(), last_checkpoint=lambda: last_ckpt)
    engine.sinks.append(heartbeat)
    watcher = PreemptionWatcher(spec.preemption).install()
    saved_at = engine.global_steps
    batches = _batches(loader)
    # A PipelineModule (the factory built it with the job's pipeline degree, `pipeline.stages` of the
    # engine config) trains through the pipeline engine's train_batch; its loss is the module's loss_fn.
    pipelined = bool(getattr(job.model, "deepfleet_pipeline", False))
    try:
        while engine.global_steps < spec.max_steps:
            if pipelined:  # one optimizer step over gradient_accumulation_steps (inputs, labels) batches
                engine.train_batch(batches)
            else:
                batch = next(batches)
                out = engine(batch)
                loss = job.loss_fn(out, batch) if job.loss_fn is not None else out
                engine.backward(loss)
                before = engine.global_steps
                engine.step()
                if engine.global_steps == before:
                    continue  # not an accumulation boundary
            step = engine.global_steps
            if spec.checkpoint is not None and spec.checkpoint.every_steps and step % spec.checkpoint.every_steps == 0:
                save()
                saved_at = step
            metrics = heartbeat.last
            assert metrics is not None and metrics.step == step  # the sink saw this step
            if step % spec.log_every_steps == 0 or step == spec.max_steps:
                _log(rank, f"step {step}/{spec.max_steps} loss {metrics.loss:.4f} restart {restart} t={time.time():.3f}")
            if watcher.should_stop():
                _log(rank, f"preemption ({watcher.reason}): checkpointing step {step}, "
                           f"{watcher.remaining_s():.1f}s of grace left")
                if saved_at != step:
                    save()
                if rank == 0:
                    mark_preempted(last_ckpt)
                    heartbeat.beat()
                _leave_group()
                exit_preempted()
        if ckpt_dir is not None and saved_at != engine.global_steps:
            save()
        if rank == 0:
            heartbeat.beat()
        _log(rank, f"done at step {engine.global_steps}" + (f", checkpoint {last_ckpt}" if last_ckpt else ""))
        _leave_group()
    finally:
        watcher.uninstall()
        reporter.close()
        sys.stdout.flush()
