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

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepfleet.engine import job_env
from deepfleet.engine.build import Training, build_training
from deepfleet.engine.dataloader import TrainingDataLoader, build_dataloader
from deepfleet.engine.dist import ensure_process_group, training_device

logger = logging.getLogger(__name__)


class DeepFleetEngine(nn.Module):
    """Wraps the user's model for training; built by `initialize`."""

    def __init__(
        self,
        model: nn.Module,
        *,
        config: Any,
        training: Training,
        training_dataloader: TrainingDataLoader | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__()
        self.module = model  # the user's unwrapped model (its parameters may be sharded at stage 3)
        self.config = config
        self.sharding = training.sharding
        self.precision = training.precision
        self.optimizer = training.optimizer
        self.lr_scheduler = training.lr_scheduler
        self.training_dataloader = training_dataloader
        self.global_steps = 0  # boundary steps taken, skipped (fp16 overflow) ones included
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._grad_norm: float | None = None
        self._losses: list[torch.Tensor] = []  # this accumulation window's unscaled micro-batch losses
        self._clock = clock
        self._timings: dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._last_report = (clock(), 0)  # (time, global_steps) at the last log line
        self._rank = dist.get_rank() if dist.is_initialized() else 0

    # --- the training protocol ------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on one micro-batch. Gradient sync is set here, before the forward, because
        DDP decides at forward time whether the coming backward communicates."""
        self.sharding.set_gradient_sync(self.is_gradient_accumulation_boundary())
        args, kwargs = self.precision.prepare_inputs(args, kwargs)
        with self._timed("forward"):
            return self.sharding.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate `loss / gradient_accumulation_steps` (unless `scale_wrt_gas` is False),
        multiplied by the loss scale (fp16). Returns `loss` unchanged."""
        self._losses.append(loss.detach())
        divisor = self.config.gradient_accumulation_steps if scale_wrt_gas else 1
        with self._timed("backward"):
            self.precision.scale_loss(loss / divisor).backward(retain_graph=retain_graph)
        return loss

    def step(self, lr_kwargs: dict | None = None) -> None:
        """End a micro-step; on the accumulation boundary, take the optimizer step (`lr_kwargs` go to
        the LR scheduler's step)."""
        if self.is_gradient_accumulation_boundary():
            with self._timed("step"):
                self._take_model_step(lr_kwargs or {})
            self._report()
        self.micro_steps += 1

    def zero_grad(self) -> None:
        """Drop accumulated gradients (the boundary step does this itself)."""
        self.sharding.zero_grad()

    def _take_model_step(self, lr_kwargs: dict) -> None:
        overflow = self.sharding.finish_gradients(grad_scale=self.precision.loss_scale)
        self._grad_norm = self.sharding.clip_grad_norm_(self.config.gradient_clipping)
        if self.precision.update(overflow):  # False: fp16 overflow, the step is skipped
            self.optimizer.step()
            self.sharding.after_optimizer_step()
            self._advance_lr(lr_kwargs)
        else:
            self.skipped_steps += 1
        self.sharding.zero_grad()
        self.global_steps += 1
        self.global_samples += self.config.train_batch_size

    def _advance_lr(self, lr_kwargs: dict) -> None:
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(**lr_kwargs)

    def train(self, mode: bool = True) -> DeepFleetEngine:
        super().train(mode)
        self.sharding.module.train(mode)  # the DDP wrapper is not a child of the engine
        return self

    # --- DeepSpeed's accessors ----------------------------------------------------------------------

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def get_lr(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]

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

    # --- checkpoints (deepfleet.engine.checkpoint does the work) -------------------------------------

    def save_checkpoint(
        self, save_dir: str | Path, tag: str | None = None, client_state: dict | None = None, **kwargs: Any
    ) -> bool:
        """Save the full training state under `<save_dir>/<tag>/`; every rank must call it."""
        from deepfleet.engine.checkpoint.api import save_checkpoint

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
        """Restore from `<load_dir>/<tag>` (default: newest complete); returns (path, client_state)."""
        if not load_module_strict:
            raise ValueError("load_module_strict: only True is supported; checkpoints must match the model")
        from deepfleet.engine.checkpoint.api import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag=tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )

    # --- logging ---------------------------------------------------------------------------------

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            self._timings[name] += self._clock() - start

    def _report(self) -> None:
        """Every `steps_per_print` steps, rank 0 logs loss, lr, grad norm, loss scale and throughput."""
        losses, self._losses = self._losses, []
        every = self.config.steps_per_print
        if self._rank != 0 or not every or self.global_steps % every != 0:
            return
        now = self._clock()
        then, steps_then = self._last_report
        self._last_report = (now, self.global_steps)
        samples = (self.global_steps - steps_then) * self.config.train_batch_size
        throughput = samples / (now - then) if now > then else float("nan")
        loss = float(torch.stack(losses).float().mean()) if losses else float("nan")
        logger.info(
            "step %d | loss %.4f | lr %s | grad_norm %.4f | loss_scale %g | skipped %d | %.1f samples/s",
            self.global_steps, loss, ", ".join(f"{lr:.3e}" for lr in self.get_lr()),
            self._grad_norm if self._grad_norm is not None else float("nan"),
            self.precision.loss_scale, self.skipped_steps, throughput,
        )
        if self.config.wall_clock_breakdown:
            steps = max(self.global_steps - steps_then, 1)
            logger.info(
                "time per step (ms) | forward %.1f | backward %.1f | optimizer step %.1f",
                *(1000 * self._timings[k] / steps for k in ("forward", "backward", "step")),
            )
        self._timings = dict.fromkeys(self._timings, 0.0)


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
) -> tuple[DeepFleetEngine, torch.optim.Optimizer, TrainingDataLoader | None, Any]:
    """Build the engine: `(engine, optimizer, training_dataloader, lr_scheduler)`, as DeepSpeed returns.

    `config` (or `config_params`, or `args.deepspeed_config`) is a dict, a JSON/YAML path or a JSON
    string in DeepSpeed's format. `optimizer` is a torch optimizer over the model's parameters or a
    factory taking param groups; `lr_scheduler` a scheduler or a factory taking the optimizer.
    Raises ValueError (ConfigError for the config) naming the offending argument or key."""
    from deepfleet.engine.config import DeepFleetConfig, load_config

    if model is None:
        raise ValueError("model: required; pass model=<your torch.nn.Module>")
    if mpu is not None:
        raise ValueError("mpu: external model-parallel units are not supported; drop the mpu argument")
    source = config if config is not None else config_params
    if source is None:
        source = getattr(args, "deepspeed_config", None)
    if source is None:  # a script run by a deepfleet job: the spec's engine config
        source = job_env.engine_config()
    if source is None:
        raise ValueError("config: required; pass config=<dict or path to a DeepSpeed-style JSON/YAML>")
    ensure_process_group()
    world_size, rank = dist.get_world_size(), dist.get_rank()
    cfg = source if isinstance(source, DeepFleetConfig) else load_config(source, world_size=world_size)
    if cfg.dump_state and rank == 0:
        logger.info("engine config: %s", json.dumps(cfg.to_dict(), sort_keys=True))

    model.to(training_device())
    training = build_training(
        model, cfg, optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler
    )
    loader = None
    if training_data is not None:
        loader = build_dataloader(
            training_data,
            micro_batch_size=cfg.train_micro_batch_size_per_gpu,
            num_replicas=world_size,
            rank=rank,
            seed=cfg.seed,
            collate_fn=collate_fn,
        )
    engine = DeepFleetEngine(model, config=cfg, training=training, training_dataloader=loader)
    return engine, engine.optimizer, loader, engine.lr_scheduler
