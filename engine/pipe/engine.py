"""The pipeline engine: DeepSpeed's `PipelineEngine` (`train_batch`, `eval_batch`, `is_first_stage`,
`is_last_stage`) on torch.distributed.pipelining, composed with data parallelism and ZeRO 0-2.

`deepfleet.engine.initialize` hands a `PipelineModule` to `initialize_pipeline` here. The mesh's `pp`
axis carries the stages (its group is what `PipelineStage`s talk over); the ZeRO strategy of
`zero_optimization.stage` wraps this rank's layers over the `dp` group exactly as without pipelining
(`engine/build.py`, unchanged), so ZeRO-1 and ZeRO-2 partition each stage's optimizer state and
gradients across that stage's data-parallel replicas.

One `train_batch` is one optimizer step: it takes `gradient_accumulation_steps` micro-batches
(DeepSpeed's meaning), runs them through the configured schedule, and returns the mean loss over the
micro-batches and the data-parallel replicas on every rank. The loss each micro-batch backpropagates
is `loss / gradient_accumulation_steps` times the loss scale. The optimizer step is the base engine's
`_take_model_step`, with two pipeline-wide parts overridden: after the strategy's data-parallel
reduction, tied weights' gradients are summed over the stages that hold them (`tied.py`) and overflow
is agreed over the pipeline; the global gradient norm sums every stage's squares over the `pp` group
(a tied weight counted once, on its first stage) and clips with it.

What composes, measured here: ZeRO 0, 1, 2 with GPipe, 1F1B, Interleaved1F1B; ZeRO 0 and 1 with the
split-backward schedules (InterleavedZeroBubble, ZBV, DualPipeV), whose weight gradients accumulate
outside autograd's hooks, which ZeRO-2's gradient partitioning needs.
ZeRO-3 with pipelining is refused: the stage's chunks run outside the FSDP root's unshard hooks (tried with
the refusal lifted, pp 2 x dp 2, 1F1B: "aten.mm.default got mixed torch.Tensor and DTensor"); making it
work means `fully_shard` per chunk and the FSDP chunk as the PipelineStage's module.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from deepfleet.engine import comm
from deepfleet.engine.build import build_training
from deepfleet.engine.compat import groups as compat_groups
from deepfleet.engine.config import ConfigError, DeepFleetConfig
from deepfleet.engine.config_pipeline import SCHEDULE_CHUNKS
from deepfleet.engine.config_source import read_source
from deepfleet.engine.data_sampling import build_curriculum_loader
from deepfleet.engine.dataloader import build_dataloader
from deepfleet.engine.dist import ensure_process_group, training_device
from deepfleet.engine.engine import DeepFleetEngine, _config_and_degrees
from deepfleet.engine.pipe.replicated import ReplicatedStrategy
from deepfleet.engine.pipe.schedule import SPLIT_BACKWARD, build_schedule, build_stages
from deepfleet.engine.pipe.state import StageState
from deepfleet.engine.pipe.tied import TiedWeights
from deepfleet.engine.zero.gradients import clip_to_norm_, global_norm


class PipelineEngine(DeepFleetEngine):
    """Runs a PipelineModule (see the module docstring); built by `initialize_pipeline`."""

    def __init__(self, model: nn.Module, *, tied: TiedWeights, schedule_name: str, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.tied = tied
        self.schedule_name = schedule_name
        pp_mesh = self.parallel.submesh("pp")
        self._pp_group = pp_mesh.get_group()
        chunks = model.stage_chunks
        num_parts = model.num_stages * model.chunks_per_rank
        self._holds_first = any(c.part == 0 for c in chunks)
        self._holds_last = any(c.part == num_parts - 1 for c in chunks)
        # the pp-group rank that holds the last part (computes the loss)
        self._last_rank = model.num_stages - 1 if model.layout == "loop" else 0
        # The stages run this rank's chunks themselves (stage 0 is replicated.py's strategy, not DDP).
        subs = [(c, c.part) for c in chunks]
        self._stages = build_stages(subs, num_parts=num_parts, device=training_device(), group=self._pp_group)
        self._schedule = build_schedule(
            schedule_name, self._stages, micro_batches=self.config.gradient_accumulation_steps, loss_fn=self._loss
        )
        # parameter -> the tensor the optimizer updates for it (tied-gradient sum, clipping)
        tied_params = tied.tied_params()
        mapped = self.sharding.optimizer_param_groups([{"params": tied_params}])[0]["params"] if tied_params else []
        self._opt_tensor_of = {id(p): t for p, t in zip(tied_params, mapped, strict=True)}
        self._not_counted = {id(self._opt_tensor_of[i]) for i in tied.non_owned()}
        self._data_iterator: Iterator | None = None
        # checkpoints see the whole pipeline's optimizer groups (engine/checkpoint/ reads engine.sharding)
        self.sharding = StageState(self.sharding, module=model, pp_group=self._pp_group)

    # --- DeepSpeed's pipeline API ---------------------------------------------------------------

    def is_first_stage(self) -> bool:
        """Whether this rank runs the first layers (reads the inputs)."""
        return self._holds_first

    def is_last_stage(self) -> bool:
        """Whether this rank runs the last layers and the loss (reads the labels)."""
        return self._holds_last

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """One optimizer step over `gradient_accumulation_steps` micro-batches `(inputs, labels)` from
        `data_iter` (default: the engine's training data); returns the mean loss, on every rank."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch: gradients are disabled (torch.no_grad); use eval_batch to evaluate")
        self.module.train()
        gas = self.config.gradient_accumulation_steps
        args, target = self._next_batch(data_iter, gas)
        # The schedule runs every micro-batch's backward inside one call, so no backward is the window's
        # last one to the strategy: it reduces in finish_gradients (stage 2, by default, on every backward).
        self.sharding.set_gradient_sync(False)
        losses: list[torch.Tensor] = []
        with self._recorder.timed("forward"), self._counting("forward"):
            self._schedule.step(*args, target=target, losses=losses if self._holds_last else None,
                                return_outputs=False)
        self.memory.sample("backward")
        loss = self._mean_loss(losses, scale=self.precision.loss_scale / gas)
        self._recorder.add_loss(loss)
        self.micro_steps += gas - 1
        self._take_model_step({})
        self.micro_steps += 1
        return loss

    def eval_batch(
        self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
        reduce_output: str | None = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None,
    ) -> Any:
        """Forward only over `gradient_accumulation_steps` micro-batches; the mean loss on every rank
        (with `return_logits`, `(loss, outputs)`, the outputs on the last stage and None elsewhere)."""
        if num_micro_batches not in (None, self.config.gradient_accumulation_steps):
            raise ValueError("num_micro_batches: only gradient_accumulation_steps micro-batches are supported")
        if self.module.layout == "v":
            raise ValueError(
                f"eval_batch: pipeline.schedule {self.schedule_name} (V layout) has no forward-only mode in torch "
                "2.13's pipelining; evaluate with a module laid out for 1F1B, GPipe or Interleaved1F1B"
            )
        if reduce_output not in ("avg", None):
            raise ValueError(f"reduce_output: {reduce_output!r}; use 'avg' or None")
        self.module.eval()
        gas = self.config.gradient_accumulation_steps
        args, target = self._next_batch(data_iter, gas)
        losses: list[torch.Tensor] = []
        with torch.no_grad():
            outputs = self._schedule.eval(*args, target=target, losses=losses if self._holds_last else None)
        loss = self._mean_loss(losses, scale=1.0 / gas) if compute_loss else None
        self.module.train()
        if return_logits:
            return loss, outputs if self._holds_last else None
        return loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("PipelineEngine: call engine.train_batch() / eval_batch() instead of engine(batch)")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("PipelineEngine: train_batch() runs the backward passes; do not call backward()")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("PipelineEngine: train_batch() takes the optimizer step; do not call step()")

    def set_dataiterator(self, iterator: Iterator) -> None:
        """Where `train_batch()` without an argument reads from (DeepSpeed's name)."""
        self._data_iterator = iterator

    # --- pieces -----------------------------------------------------------------------------------

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        """The loss of one micro-batch as backpropagated: the module's loss (or the output itself when
        it has none) divided by the micro-batch count, times the loss scale."""
        fn = self.module.loss_fn
        raw = fn(output, target) if fn is not None else output
        if not torch.is_grad_enabled():
            return raw / self.config.gradient_accumulation_steps
        return raw * (self.precision.loss_scale / self.config.gradient_accumulation_steps)

    def _next_batch(self, data_iter: Iterator | None, gas: int) -> tuple[tuple, Any]:
        """`gas` micro-batches concatenated on dim 0 (the schedule splits them again): the first stage's
        inputs and the last stage's labels; ranks holding neither read nothing."""
        if not (self._holds_first or self._holds_last):
            return (), None
        it = data_iter if data_iter is not None else self._default_iterator()
        batches = list(itertools.islice(it, gas))
        if len(batches) < gas:
            raise ValueError(f"data_iter: ran out after {len(batches)} of {gas} micro-batches; use a repeating iterator")
        inputs = [b[0] for b in batches]
        labels = [b[1] for b in batches]
        args: tuple = ()
        if self._holds_first:
            args = tuple(_cat(inputs)) if isinstance(inputs[0], (tuple, list)) else (torch.cat(inputs),)
            args, _ = self.precision.prepare_inputs(args, {})
            for x in inputs:
                self._recorder.micro_batch(tuple(x) if isinstance(x, (tuple, list)) else (x,), {})
        target = None
        if self._holds_last:
            target = tuple(_cat(labels)) if isinstance(labels[0], (tuple, list)) else torch.cat(labels)
        return args, target

    def _default_iterator(self) -> Iterator:
        if self._data_iterator is None:
            if self.training_dataloader is None:
                raise ValueError("data_iter: required when initialize() got no training_data")
            self._data_iterator = _repeat(self.training_dataloader)
        return self._data_iterator

    def _mean_loss(self, losses: list[torch.Tensor], *, scale: float) -> torch.Tensor:
        """Mean micro-batch loss from the last stage, averaged over data parallelism, on every rank."""
        if self._holds_last:
            # each entry is raw_loss * scale; the mean of the raw losses
            value = torch.stack([x.detach().float() for x in losses]).sum() / (scale * len(losses))
            comm.all_reduce(value, op=comm.ReduceOp.AVG, group=self.parallel.dp_group)
        else:
            value = torch.zeros((), dtype=torch.float32)
        value = value.reshape(1)
        comm.broadcast(value, group=self._pp_group, group_src=self._last_rank)
        return value.reshape(())

    def _finish_gradients(self) -> bool:
        overflow = self.sharding.finish_gradients(grad_scale=self.precision.loss_scale)
        self.tied.allreduce_grads({i: t.grad for i, t in self._opt_tensor_of.items()})
        flag = torch.tensor([1.0 if overflow else 0.0])
        comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self._pp_group)
        return bool(flag.item() > 0)

    def _clip_gradients(self) -> float:
        grads = [t.grad for g in self.optimizer.param_groups for t in g["params"] if t.grad is not None]
        counted = [t.grad for g in self.optimizer.param_groups for t in g["params"]
                   if t.grad is not None and id(t) not in self._not_counted]
        square = global_norm(counted).pow(2).reshape(1)  # this stage's, over its data-parallel group
        comm.all_reduce(square, op=comm.ReduceOp.SUM, group=self._pp_group)
        norm = float(square.sqrt().item())
        clip_to_norm_(grads, self.config.gradient_clipping, norm=norm)
        return norm


def _cat(parts: list[Any]) -> list[torch.Tensor]:
    return [torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))]


def _repeat(loader: Any) -> Iterator:
    while True:
        yield from loader


def _pipeline_source(source: Any, model: Any) -> dict:
    """The raw config with `pipeline.stages` set from the module (it must agree when given)."""
    if isinstance(source, DeepFleetConfig):
        raw = source.to_dict()
    else:
        errors: list[str] = []
        raw = read_source(source, errors)
        if raw is None:
            raise ConfigError(errors)
    section = dict(raw.get("pipeline") or {})
    stages = section.get("stages", "auto")
    if stages not in ("auto", None, model.num_stages):
        raise ConfigError([f"pipeline.stages: {stages} but the PipelineModule has num_stages={model.num_stages}; "
                           "drop pipeline.stages or make them equal"])
    section["stages"] = model.num_stages
    return {**raw, "pipeline": section}


def _schedule_name(cfg: Any, model: Any) -> str:
    name = cfg.pipeline.schedule or model.schedule or "1F1B"
    chunks, layout = SCHEDULE_CHUNKS[name]
    fits = layout == model.layout and (chunks == model.chunks_per_rank if chunks else model.chunks_per_rank >= 2)
    if not fits:
        raise ConfigError([
            f"pipeline.schedule: {name} runs {chunks or '2 or more'} chunk(s) per rank ({layout} layout), but the "
            f"PipelineModule was split for {model.schedule or '1F1B'}; pass PipelineModule(..., schedule=\"{name}\")"
        ])
    return name


def _check_composition(cfg: Any, *, name: str) -> None:
    stage = cfg.zero_optimization.stage
    if stage == 3:
        raise ConfigError(["zero_optimization.stage: 3 with pipeline parallelism is not supported; use stage <= 2 "
                           "(stage 2 partitions gradients and optimizer state over each stage's replicas)"])
    blocks_ac = cfg.deepfleet_activation_checkpointing
    if blocks_ac.mode != "off" or blocks_ac.offload:
        raise ConfigError(["deepfleet_activation_checkpointing: not supported with pipeline parallelism; use "
                           "pipeline.activation_checkpoint_interval (the stages' layers are checkpointed there)"])
    if cfg.deepfleet_differential_privacy.enabled:
        raise ConfigError(["deepfleet_differential_privacy.enabled: not supported with pipeline parallelism (each "
                           "stage sees only its own layers' per-sample gradients); train without a PipelineModule"])
    if stage == 2 and name in SPLIT_BACKWARD:
        raise ConfigError([f"zero_optimization.stage: 2 with pipeline.schedule {name} is not supported (its weight "
                           "gradients bypass ZeRO-2's gradient hooks); use stage 1 or a schedule without split backward"])


def initialize_pipeline(
    *, model: Any, source: Any, optimizer: Any, model_parameters: Any, training_data: Any,
    lr_scheduler: Any, collate_fn: Any,
) -> tuple[PipelineEngine, torch.optim.Optimizer, Any, Any]:
    """`initialize` for a PipelineModule: `(engine, optimizer, training_dataloader, lr_scheduler)`."""
    ensure_process_group()
    world_size, rank = comm.get_world_size(), comm.get_rank()
    cfg, parallel = _config_and_degrees(_pipeline_source(source, model), world_size=world_size)
    name = _schedule_name(cfg, model)
    _check_composition(cfg, name=name)
    if cfg.pipeline.activation_checkpoint_interval:
        for chunk in model.stage_chunks:
            chunk._ac_interval = cfg.pipeline.activation_checkpoint_interval
    device = training_device()
    parallel.build_mesh(device.type)
    model.to(device)
    # Tied copies are made equal before the strategy takes its fp32 masters from them.
    tied = TiedWeights.build(model, mesh_ranks=parallel.mesh.mesh, rank=rank)
    training = build_training(model, cfg, optimizer=optimizer, model_parameters=model_parameters,
                              lr_scheduler=lr_scheduler, process_group=parallel.grad_group,
                              strategy=ReplicatedStrategy if cfg.zero_optimization.stage == 0 else None)
    loader = None
    if training_data is not None and cfg.data_efficiency.data_curriculum() is not None:
        loader = build_curriculum_loader(training_data, cfg, dp_rank=parallel.dp_rank, dp_size=parallel.dp_size,
                                         global_rank=rank, collate_fn=collate_fn)
    elif training_data is not None:
        loader = build_dataloader(training_data, micro_batch_size=cfg.train_micro_batch_size_per_gpu,
                                  num_replicas=parallel.dp_size, rank=parallel.dp_rank, seed=cfg.seed,
                                  collate_fn=collate_fn)
    engine = PipelineEngine(model, config=cfg, training=training, parallel=parallel, training_dataloader=loader,
                            tied=tied, schedule_name=name)
    compat_groups.set_parallel(parallel)  # deepspeed.utils.groups answers for this engine
    return engine, engine.optimizer, loader, engine.lr_scheduler
