"""The training engine and `initialize`, DeepSpeed-shaped: `import deepfleet.engine as deepspeed` ports a
script that calls `deepspeed.initialize(...)`, `engine(batch)`, `engine.backward(loss)`, `engine.step()`.

Called by user scripts and by the worker's managed training loop. The engine only sequences: what
happens to gradients and weights is the ZeRO strategy's business (`zero/`), loss scaling and
skip-on-overflow the precision policy's (`precision.py`), and the order in which features are applied
is `build.py`'s. Micro-step protocol (DeepSpeed's): the user calls forward, backward and `step()` on every
micro-batch; `step()` updates the weights only on the gradient-accumulation boundary, and every call
advances `micro_steps`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepfleet.engine import comm, job_env
from deepfleet.engine.autotp import model_tp_size
from deepfleet.engine.build import Training, build_training
from deepfleet.engine.compat import checkpointing as compat_checkpointing
from deepfleet.engine.compat import groups as compat_groups
from deepfleet.engine.compat import zero as compat_zero
from deepfleet.engine.compat.args import config_from_args
from deepfleet.engine.compat.engine_members import DeepSpeedEngineMembers
from deepfleet.engine.config_parallel import raw_dp_size
from deepfleet.engine.curriculum import ModelSchedules
from deepfleet.engine.data_sampling import CurriculumDataLoader, build_curriculum_loader
from deepfleet.engine.dataloader import TrainingDataLoader, build_dataloader
from deepfleet.engine.dist import ensure_process_group, training_device
from deepfleet.engine.eigenvalue import Eigenvalue
from deepfleet.engine.memory import HighWater
from deepfleet.engine.metrics import StepRecorder, StepSink
from deepfleet.engine.moe import layer as _moe_layer  # noqa: F401 - loaded with the package: scripts reach `deepspeed.moe.layer.MoE`
from deepfleet.engine.moe.groups import bind_expert_parallel, model_ep_sizes
from deepfleet.engine.parallel import ParallelDims
from deepfleet.engine.privacy import DPSGD, build_privacy
from deepfleet.engine.zero.construction import gather_whole

logger = logging.getLogger(__name__)


class DeepFleetEngine(DeepSpeedEngineMembers, nn.Module):
    """Wraps the user's model for training; built by `initialize`. DeepSpeed's further engine members
    (ranks, precision/ZeRO queries, attribute fall-through to the model) are the mixin's."""

    def __init__(
        self,
        model: nn.Module,
        *,
        config: Any,
        training: Training,
        parallel: ParallelDims,
        training_dataloader: TrainingDataLoader | CurriculumDataLoader | None = None,
        clock: Callable[[], float] = time.perf_counter,
        privacy: DPSGD | None = None,
    ) -> None:
        super().__init__()
        self.module = model  # the user's unwrapped model (its parameters may be sharded at stage 3)
        self.config = config
        self.parallel = parallel  # degrees, the mesh and the data-parallel group (engine/parallel.py)
        self.sharding = training.sharding
        self.precision = training.precision
        self.optimizer = training.optimizer
        self.lr_scheduler = training.lr_scheduler
        self.compression = training.compression  # compression schedule (engine/compression/) or None
        self.training_dataloader = training_dataloader
        self.privacy = privacy  # DP-SGD (engine/privacy.py) or None
        # progressive layer drop / legacy curriculum: keywords for the model's forward (engine/curriculum.py)
        self.model_schedules = ModelSchedules(config)
        self.random_ltd_scheduler = None  # random-LTD (engine/data_routing.py), when configured
        self._token_drop_hooks = None
        if config.data_efficiency.random_ltd() is not None:
            self._build_random_ltd(config)
        self.global_steps = 0  # boundary steps taken, skipped (fp16 overflow) ones included
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._grad_norm: float | None = None
        self.sinks: list[StepSink] = list(training.sinks)  # called with each step's StepMetrics, in order
        self.flops = training.flops  # StepFlops (engine/profiling/step_flops.py) or None
        self.comm_policy = training.comm_policy  # gradient compression (engine/gradcomp/policy.py) or None
        self.checkpointing = training.checkpointing  # each block's activation-checkpointing choice ([] = none)
        # block Hessian eigenvalues at accumulation boundaries (engine/eigenvalue.py), when configured
        self.eigenvalue = Eigenvalue.from_config(config.eigenvalue) if config.eigenvalue.enabled else None
        self.block_eigenvalue: dict[int, list[float]] | None = None
        self._eigenvalue_fresh = False
        # end-of-training summaries and monitor files: at destroy(), or when the engine is collected or
        # the interpreter exits, whichever comes first (the finalizer runs once)
        self._close_sinks = weakref.finalize(self, close_sinks, self.sinks)
        self._recorder = StepRecorder(rank=comm.get_rank(), dp_size=parallel.dp_size, clock=clock)
        # model-state high-water mark over the current optimizer step, and the last completed step's
        self.memory = HighWater(self.sharding)
        self.peak_model_state_bytes = 0
        if training_dataloader is not None:  # batch fetches from our own loader are the "data" phase
            training_dataloader.fetch_timer = lambda: self._recorder.timed("data")

    # --- the training protocol ------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on one micro-batch. Gradient sync is set here, before the forward, because
        DDP decides at forward time whether the coming backward communicates."""
        # DP-SGD clips per sample over all parameters first: nothing is reduced inside backward
        self.sharding.set_gradient_sync(self.privacy is None and self.is_gradient_accumulation_boundary())
        if torch.is_grad_enabled():  # a training micro-batch (evaluation forwards count no tokens)
            self._recorder.micro_batch(args, kwargs)
        kwargs = {**kwargs, **self.model_schedules.forward_kwargs(
            next_step=self.global_steps + 1, training=self.module.training)}
        if self.random_ltd_scheduler is not None:  # one draw of kept tokens per micro-batch
            self.random_ltd_scheduler.new_micro_batch(self.micro_steps)
        args, kwargs = self.precision.prepare_inputs(args, kwargs)
        with self._recorder.timed("forward"), self._counting("forward"), self._eigenvalue_forward():
            out = self.sharding.module(*args, **kwargs)
        self.memory.sample("forward")
        return out

    # --- random-LTD (DeepSpeed's data_efficiency.data_routing.random_ltd) -----------------------------

    def _build_random_ltd(self, config: Any) -> None:
        from deepfleet.engine import data_routing

        section = config.data_efficiency.random_ltd()
        self.random_ltd_scheduler = data_routing.RandomLTDScheduler(
            section, global_batch_size=config.train_batch_size, seed=config.data_efficiency.seed,
            rank=self.parallel.dp_rank)
        self.model_schedules.random_ltd = self.random_ltd_scheduler
        if any(isinstance(m, data_routing.RandomLayerTokenDrop) for m in self.module.modules()):
            data_routing.bind_wrappers(self.module, self.random_ltd_scheduler)
        else:  # hooks on the listed blocks: the model itself is not rewritten
            self._token_drop_hooks = data_routing.TokenDropHooks(
                self.random_ltd_scheduler, data_routing.layers_to_drop(self.module, section))

    def random_ltd_enabled(self) -> bool:
        return self.random_ltd_scheduler is not None

    def random_ltd_initialize(self) -> None:
        """DeepSpeed's call after `convert_to_random_ltd`: bind the model's RandomLayerTokenDrop wrappers to
        the scheduler (replacing the engine's own hooks)."""
        from deepfleet.engine import data_routing

        if self.random_ltd_scheduler is None:
            raise ValueError("data_efficiency.data_routing.random_ltd: not enabled; enable data_efficiency, "
                             "data_routing and random_ltd in the config")
        if self._token_drop_hooks is not None:
            self._token_drop_hooks.remove()
            self._token_drop_hooks = None
        data_routing.bind_wrappers(self.module, self.random_ltd_scheduler)

    def _eigenvalue_due(self) -> bool:
        return (self.eigenvalue is not None and torch.is_grad_enabled() and self.is_gradient_accumulation_boundary()
                and (self.global_steps + 1) % self.eigenvalue.gas_boundary_resolution == 0)

    def _eigenvalue_forward(self) -> contextlib.AbstractContextManager:
        """The math attention kernel on the micro-batch whose loss the eigenvalues are taken of (the
        fused kernels have no double backward)."""
        if not self._eigenvalue_due():
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate `loss / gradient_accumulation_steps` (unless `scale_wrt_gas` is False),
        multiplied by the loss scale (fp16). Returns `loss` unchanged."""
        self._recorder.add_loss(loss)
        if self._eigenvalue_due() and loss.requires_grad:
            with self._recorder.timed("eigenvalue"):
                self.block_eigenvalue = self.eigenvalue.block_eigenvalues(
                    loss, self.module, seed=self.global_steps, group=self.parallel.dp_group)
            self._eigenvalue_fresh = True
        divisor = self.config.gradient_accumulation_steps if scale_wrt_gas else 1
        quiet = self.privacy.backward_context() if self.privacy is not None else contextlib.nullcontext()
        with self._recorder.timed("backward"), self._counting("backward"), quiet:
            self.precision.scale_loss(loss / divisor).backward(retain_graph=retain_graph)
            if self.privacy is not None:
                self.privacy.after_backward()
        self.memory.sample("backward")
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """End a micro-step; on the accumulation boundary, take the optimizer step (`lr_kwargs` go to
        the LR scheduler's step)."""
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            self._take_model_step(lr_kwargs or {})
            self.tput_timer.step_done()
        self.micro_steps += 1

    def zero_grad(self) -> None:
        """Drop accumulated gradients (the boundary step does this itself)."""
        self.sharding.zero_grad()

    def _take_model_step(self, lr_kwargs: dict) -> None:
        """The optimizer step of one accumulation window, then its StepMetrics to every sink."""
        with self._recorder.timed("step"):
            overflow = self._finish_gradients()
            self._grad_norm = self._clip_gradients()
            stepped = self.precision.update(overflow)  # False: fp16 overflow, the step is skipped
            self._step_applied = stepped
            if stepped:
                self.optimizer.step()
                self.memory.sample("optimizer_step")  # new optimizer state beside the gradients
                self.sharding.after_optimizer_step()
                self._advance_lr(lr_kwargs)
            else:
                self.skipped_steps += 1
            self.sharding.zero_grad()
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size
        self.model_schedules.step_done(self.global_steps)
        if self.compression is not None:  # schedules advance with engine steps, skipped ones included
            self.compression.step(self.global_steps)
        self.memory.sample("step")
        self.peak_model_state_bytes = self.memory.peak_bytes()
        self.memory.reset()
        metrics = self._recorder.finish(
            step=self.global_steps, lr=self.get_lr()[0], lrs=tuple(self.get_lr()), grad_norm=self._grad_norm,
            loss_scale=self.precision.loss_scale, skipped=not stepped, skipped_steps=self.skipped_steps,
            samples=self.config.train_batch_size, global_samples=self.global_samples,
            peak_model_state_bytes=self.peak_model_state_bytes,
        )
        if self.flops is not None:
            metrics = dataclasses.replace(metrics, **self.flops.figures(metrics))
        if self.privacy is not None:
            metrics = dataclasses.replace(metrics, dp_epsilon=self.privacy.epsilon(), dp_delta=self.privacy.delta,
                                          dp_accountant=self.privacy.accountant_kind)
        if self._eigenvalue_fresh:  # estimated in this window
            metrics = dataclasses.replace(metrics, block_eigenvalues=tuple(self.eigenvalue.last_raw))
            self._eigenvalue_fresh = False
        if self.comm_policy is not None:  # its guard's figures (and, past a threshold, its fallback)
            metrics = dataclasses.replace(metrics, **self.comm_policy.end_step(metrics.loss))
        for sink in self.sinks:
            sink(metrics)

    def _finish_gradients(self) -> bool:
        """Reduce the window's gradients (the strategy's); True when some rank overflowed."""
        if self.privacy is not None:
            self.privacy.finish()
        return self.sharding.finish_gradients(grad_scale=self.precision.loss_scale)

    def _clip_gradients(self) -> float:
        """Clip to `gradient_clipping` over every rank's gradients; the pre-clip global norm."""
        return self.sharding.clip_grad_norm_(self.config.gradient_clipping)

    def _counting(self, phase: str) -> Any:
        """FLOP counting of this phase on the profiled step (a no-op context on every other step)."""
        if self.flops is None:
            return contextlib.nullcontext()
        return self.flops.counting(self.global_steps + 1, phase)

    def _advance_lr(self, lr_kwargs: dict) -> None:
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(**lr_kwargs)

    def train(self, mode: bool = True) -> DeepFleetEngine:
        super().train(mode)
        self.sharding.module.train(mode)  # the DDP wrapper is not a child of the engine
        return self

    def destroy(self) -> None:
        """End training: sinks print their end-of-training summaries and close their files/runs."""
        self._close_sinks()

    # --- DeepSpeed's accessors ----------------------------------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._forced_boundary is not None:  # set_gradient_accumulation_boundary()
            return self._forced_boundary
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def get_lr(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def privacy_spent(self) -> tuple[float, float] | None:
        """`(epsilon, delta)` spent so far under `deepfleet_differential_privacy`; None when it is disabled."""
        if self.privacy is None:
            return None
        return self.privacy.epsilon(), self.privacy.delta

    def get_global_grad_norm(self) -> float | None:
        """The pre-clip global gradient norm of the last optimizer step (None before the first)."""
        return self._grad_norm

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    @property
    def loss_scale(self) -> float:
        return self.precision.loss_scale

    def record_dataset(self, uri: str, digest: str | None = None) -> str:
        """Report the data source this run trains on for the job's provenance (a local path is hashed
        when `digest` is omitted; see `deepfleet.engine.provenance`). Returns the digest."""
        from deepfleet.engine.provenance import record_dataset

        return record_dataset(uri, digest)

    # --- checkpoints (deepfleet.engine.checkpoint does the work) -------------------------------------

    def save_checkpoint(
        self, save_dir: str | Path, tag: str | None = None, client_state: dict | None = None, **kwargs: Any
    ) -> bool:
        """Save the full training state under `<save_dir>/<tag>/`; every rank must call it. Its seconds
        reach the next step's `timings["checkpoint"]` (goodput's checkpoint stalls)."""
        from deepfleet.engine.checkpoint.api import save_checkpoint

        with self._recorder.timed("checkpoint"):
            return save_checkpoint(self, save_dir, tag=tag, client_state=client_state, **kwargs)

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[str | None, dict | None]:
        """Restore from `<load_dir>/<tag>` (default: newest complete); returns (path, client_state).
        `load_module_strict=False` keeps model tensors the checkpoint lacks and ignores extra ones."""
        from deepfleet.engine.checkpoint.api import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
            load_module_strict=load_module_strict,
        )

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """`zero_optimization.stage3_gather_16bit_weights_on_model_save` (what HF/Accelerate ask)."""
        return bool(self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save)

    def save_16bit_model(
        self, save_dir: str | Path, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Write the model's weights in the compute dtype as a plain state dict (rank 0); every rank must
        call it. At stage 3 only with `stage3_gather_16bit_weights_on_model_save`, else returns False."""
        from deepfleet.engine.checkpoint.model_file import save_16bit_model

        return save_16bit_model(
            self.module, save_dir, save_filename, dtype=self.precision.compute_dtype,
            gather_sharded=self.zero_gather_16bit_weights_on_model_save(),
            exclude_frozen_parameters=exclude_frozen_parameters,
        )

    def save_fp16_model(self, save_dir: str | Path, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of `save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """Stage 3: the full state dict in the compute dtype on rank 0 (None elsewhere); collective."""
        from deepfleet.engine.checkpoint.model_file import consolidated_16bit_state_dict

        return consolidated_16bit_state_dict(
            self.module, dtype=self.precision.compute_dtype, exclude_frozen_parameters=exclude_frozen_parameters
        )


def close_sinks(sinks: list[StepSink]) -> None:
    """Close every sink that has a `close()`; one that raises is logged and the rest still close."""
    for sink in sinks:
        close = getattr(sink, "close", None)
        if close is None:
            continue
        try:
            close()
        except Exception as e:  # noqa: BLE001 - best effort at the end of training
            logger.warning("closing step sink %r failed: %s", sink, e)


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    config_params: Any = None,
) -> tuple[DeepFleetEngine, torch.optim.Optimizer, TrainingDataLoader | CurriculumDataLoader | None, Any]:
    """Build the engine: `(engine, optimizer, training_dataloader, lr_scheduler)`, as DeepSpeed returns.

    `config` (or `config_params`, or `args.deepspeed_config`) is a dict, a JSON/YAML path or a JSON
    string in DeepSpeed's format. `optimizer` is a torch optimizer over the model's parameters or a
    factory taking param groups; `lr_scheduler` a scheduler or a factory taking the optimizer.
    Raises ValueError (ConfigError for the config) naming the offending argument or key."""
    if model is None:
        raise ValueError("model: required; pass model=<your torch.nn.Module>")
    if getattr(model, "deepfleet_pipeline", False):  # a PipelineModule: the pipeline engine (engine/pipe/)
        from deepfleet.engine.pipe.engine import initialize_pipeline

        return initialize_pipeline(model=model, source=_config_source(args, config, config_params), optimizer=optimizer,
                                   model_parameters=model_parameters, training_data=training_data,
                                   lr_scheduler=lr_scheduler, collate_fn=collate_fn)
    if mpu is not None:
        raise ValueError(
            "mpu: Megatron-style model-parallel units are not supported (tensor parallelism comes from the "
            "config's degrees on the engine's mesh); drop the mpu argument"
        )
    source = _config_source(args, config, config_params)
    ensure_process_group()
    world_size, rank = comm.get_world_size(), comm.get_rank()
    cfg, parallel = _config_and_degrees(source, world_size=world_size, model=model)
    if cfg.dump_state and rank == 0:
        logger.info("engine config: %s", json.dumps(cfg.to_dict(), sort_keys=True))

    device = training_device()
    parallel.build_mesh(device.type)
    model.to(device)
    if cfg.zero_optimization.stage != 3:  # built under deepspeed.zero.Init: whole again (zero/construction.py)
        gather_whole(model)
    bind_expert_parallel(model, parallel)  # MoE layers get their ep group before any strategy wraps them
    tp_mesh = _apply_autotp(model, cfg, parallel, device) if parallel.tp > 1 else None
    training = build_training(
        model,
        cfg,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        process_group=parallel.grad_group,  # dp, and sp ranks when sequence parallel
    )
    loader = None
    if training_data is not None and cfg.data_efficiency.data_curriculum() is not None:
        loader = build_curriculum_loader(training_data, cfg, dp_rank=parallel.dp_rank, dp_size=parallel.dp_size,
                                         global_rank=rank, collate_fn=collate_fn)
    elif training_data is not None:
        loader = build_dataloader(
            training_data,
            micro_batch_size=cfg.train_micro_batch_size_per_gpu,
            num_replicas=parallel.dp_size,
            rank=parallel.dp_rank,
            seed=cfg.seed,
            collate_fn=collate_fn,
        )
    if cfg.compile.enabled:  # after the strategy has wrapped it, so the compiled graph holds its hooks
        training.sharding.module.compile(backend=cfg.compile.backend, **cfg.compile.kwargs)
    privacy = build_privacy(cfg, model, training.sharding, group=parallel.grad_group, dp_size=parallel.dp_size,
                            dataset_size=_length(training_data))
    engine = DeepFleetEngine(model, config=cfg, training=training, parallel=parallel, training_dataloader=loader,
                             privacy=privacy)
    engine.tp_checkpoint_mesh = tp_mesh  # split tensors are checkpointed whole-shaped on it (engine/autotp.py)
    compat_groups.set_parallel(parallel)  # deepspeed.utils.groups answers for this engine
    compat_zero.register_module(model)    # deepspeed.zero.GatheredParameters finds its shards' owners
    compat_checkpointing.configure_from_engine_config(cfg)  # deepspeed.checkpointing from activation_checkpointing
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _apply_autotp(model: nn.Module, cfg: Any, parallel: ParallelDims, device: torch.device) -> Any:
    """Split the model over the tp axis (engine/autotp.py); the (tp, dp) mesh its checkpoints use."""
    from deepfleet.engine.autotp import TPCheckpointMesh, apply_autotp
    from deepfleet.engine.config import ConfigError

    refused = [(cfg.zero_optimization.stage == 3, "zero_optimization.stage 3 (use stage 0, 1 or 2, as DeepSpeed's "
                                                   "AutoTP training does)"),
               (parallel.sp > 1, "sequence_parallel_size > 1"), (parallel.ep > 1, "expert parallelism (moe ep_size)"),
               (parallel.pp > 1, "pipeline stages"),
               (cfg.deepfleet_differential_privacy.enabled, "deepfleet_differential_privacy")]
    for bad, what in refused:
        if bad:
            raise ConfigError([f"tensor_parallel.autotp_size: not supported together with {what}; "
                               "drop one of them"])
    try:
        apply_autotp(model, group=parallel.submesh("tp").get_group(), config=cfg.tensor_parallel)
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    return TPCheckpointMesh(parallel, parallel.grad_group, device.type)


def _length(data: Any) -> int | None:
    try:
        return len(data) if data is not None else None
    except TypeError:  # an iterable dataset
        return None


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The config `initialize` was given: `config`, `config_params`, the args' or the job's."""
    source = config_from_args(args, config if config is not None else config_params)
    if source is None:  # a script run by a deepfleet job: the spec's engine config
        source = job_env.engine_config()
    if source is None:
        raise ValueError("config: required; pass config=<dict or path to a DeepSpeed-style JSON/YAML>")
    return source


def _config_and_degrees(source: Any, *, world_size: int, model: nn.Module | None = None) -> tuple[Any, ParallelDims]:
    """The resolved config and the parallelism degrees it asks for, over `world_size` ranks.

    The degrees come from config sections, and the batch arithmetic needs the data-parallel size they
    leave: parse once with every rank data-parallel (exact while no section sets another degree),
    read the degrees, and re-resolve the batch from the source when data parallelism is narrower."""
    from deepfleet.engine.config import DeepFleetConfig, load_config

    if isinstance(source, DeepFleetConfig):
        cfg = source
    else:
        cfg = load_config(source, world_size=world_size, dp_size=raw_dp_size(source, world_size=world_size))
    try:
        # the model's MoE layers name their expert-parallel degree (DeepSpeed scripts set it only there)
        # (several, when layers differ: each degree gets its own groups, as in DeepSpeed)
        eps = model_ep_sizes(model, cfg.moe.ep_size if cfg.moe is not None else None) if model is not None else []
        from_model = {"ep": (max(eps), "MoE(ep_size=...)")} if eps else {}
        tp = model_tp_size(model, cfg.tensor_parallel.autotp_size)  # deepspeed.tp_model_init(model, tp_size)
        if tp is not None and tp > 1:
            from_model["tp"] = (tp, "tp_model_init(tp_size=...)")
        parallel = ParallelDims.from_config(cfg, world_size=world_size, model_degrees=from_model or None,
                                            ep_sizes=tuple(eps))
    except ValueError as e:
        from deepfleet.engine.config import ConfigError

        raise ConfigError([str(e)]) from None
    if parallel.dp_size != world_size:
        cfg = load_config(cfg.to_dict() if isinstance(source, DeepFleetConfig) else source,
                          world_size=world_size, dp_size=parallel.dp_size)
    return cfg, parallel


DeepSpeedEngine = DeepFleetEngine
"""DeepSpeed's name of the engine class (`isinstance(model, deepspeed.DeepSpeedEngine)`)."""
