"""Composition of the training features, in order: the one place that knows the order.

Called by `engine.initialize`. `build_training(...)` takes the user's model (fp32, on its device), the
resolved config and the user's optional optimizer/scheduler objects or factories, and returns what the
engine sequences: the precision policy, the ZeRO strategy, the optimizer, the LR scheduler and the
step sinks that receive each optimizer step's `StepMetrics`.
The stage picks its strategy class from `STRATEGIES`; nothing else here branches on a feature.

`prescale_gradients` and `gradient_predivide_factor` only move where DeepSpeed divides by the world size
(before or after the sum) to keep fp16 sums in range; every strategy here reduces in fp32, where the
order makes no difference, so those keys are accepted and change nothing. Any torch optimizer works at
every stage (the strategies hand it plain or DTensor tensors), so `zero_allow_untested_optimizer` is
not needed either.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deepfleet.engine import comm
from deepfleet.engine.activation_checkpointing import BlockChoice, apply_from_config
from deepfleet.engine.metrics import StepSink, sinks_from_env
from deepfleet.engine.moe.balance import bias_balancers
from deepfleet.engine.moe.utils import place_expert_param_groups
from deepfleet.engine.precision import Precision, build_precision
from deepfleet.engine.profiling.step_flops import StepFlops
from deepfleet.engine.progress import ProgressLog
from deepfleet.engine.zero.base import StrategyFactory, ZeroStrategy
from deepfleet.engine.zero.nvme import check_before_build, offload_strategy
from deepfleet.engine.zero.nvme_param import check_before_build as check_param_path
from deepfleet.engine.zero.nvme_param import param_offload_strategy

# zero_optimization.stage -> the strategy class ("module:Class"), imported only when used.
STRATEGIES: dict[int, str] = {
    0: "deepfleet.engine.zero.ddp:DDPStrategy",
    1: "deepfleet.engine.zero.stage1:ZeroStage1",
    2: "deepfleet.engine.zero.partitioned:ZeroStage2",
    3: "deepfleet.engine.zero.fsdp:FSDPStrategy",
}


@dataclass
class Training:
    """What `build_training` returns for the engine to drive."""

    precision: Precision
    sharding: ZeroStrategy
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any  # a torch LRScheduler, a user scheduler with .step(), or None
    sinks: list[StepSink] = field(default_factory=list)  # called in order with every step's StepMetrics
    compression: Any = None  # a CompressionScheduler (stepped with the engine, checkpointed), or None
    flops: Any = None  # StepFlops (FLOPs, MFU, HFU per step; engine/profiling/step_flops.py), or None
    comm_policy: Any = None  # GradientCompression (engine/gradcomp/policy.py), or None
    checkpointing: list[BlockChoice] = field(default_factory=list)  # per block of blocks(model); [] = none


def strategy_class(stage: int) -> StrategyFactory:
    """The strategy class for a ZeRO stage."""
    if stage not in STRATEGIES:
        raise ValueError(f"zero_optimization.stage: {stage} is not a ZeRO stage; use one of {sorted(STRATEGIES)}")
    module, name = STRATEGIES[stage].split(":")
    return getattr(importlib.import_module(module), name)


def build_training(
    model: nn.Module,
    config: Any,
    *,
    optimizer: torch.optim.Optimizer | Callable[..., torch.optim.Optimizer] | None = None,
    model_parameters: Iterable[Any] | None = None,
    lr_scheduler: Any = None,
    process_group: Any = None,
    strategy: StrategyFactory | None = None,
) -> Training:
    """Apply precision, param groups, sharding, optimizer and LR schedule to `model`, in that order, and
    compose the step sinks."""
    _check_one_source("optimizer", config.optimizer, optimizer)
    _check_one_source("scheduler", config.scheduler, lr_scheduler)
    _check_offload(model, config.zero_optimization)

    # 0. Compression before everything: it swaps layers and adds score parameters, which the param
    #    groups (2) must see, and it computes masks from full, unsharded fp32 weights (3 shards them).
    compression = _compression(model, config, process_group=process_group)

    # 0b. Activation checkpointing of the blocks after compression (which swaps layers inside them; the
    #     checkpoint hooks sit on the blocks) and before sharding: FSDP2's hooks, registered later on the
    #     same blocks, run outside the checkpoint's, so the recomputation finds parameters gathered by
    #     FSDP2's pre-backward hook (torch's composition order for fully_shard and checkpoint).
    checkpointing = apply_from_config(model, config.deepfleet_activation_checkpointing)

    # 1. Precision first: the strategy needs the compute dtype, and must see the fp32 model so its
    #    master weights are exact (it casts the model itself, or casts per forward at stage 3).
    precision = build_precision(config)

    # 2. Param groups are read before sharding: stage 3 replaces the parameters with DTensor shards
    #    and the strategy maps the user's groups onto them by identity.
    groups = _param_groups(model, model_parameters, optimizer)
    #    Expert parameters bound to an ep mesh move to groups of their own that name the
    #    expert-data-parallel group they reduce over (moe/utils.py); every strategy reads that key.
    groups = place_expert_param_groups(groups)

    # 3. The gradient compression policy is installed in engine/comm.py (or cleared, so an earlier engine's
    #    does not leak into this one) before the strategy: ZeRO-3 sets FSDP2's reduce-scatter hook by it, and
    #    every strategy's gradient reductions go through it from the first step.
    comm_policy = _comm_policy(config)
    comm.set_gradient_policy(comm_policy)

    # 3b. The sharding strategy wraps the model (DDP, our partitioning, or FSDP2).
    #    `strategy` replaces the stage's class (the pipeline engine's stage 0, engine/pipe/replicated.py).
    sharding = (strategy or strategy_class(config.zero_optimization.stage))(
        model,
        compute_dtype=precision.compute_dtype,
        zero_config=config.zero_optimization,
        process_group=process_group,
    )

    # 4. The optimizer is built over the tensors the strategy updates (masters or shards), never
    #    over the model's parameters, and the strategy is told about it (state accounting, save/load).
    opt = _optimizer(optimizer, sharding.optimizer_param_groups(groups), config)
    sharding.bind_optimizer(opt)
    #    NVMe offload keeps the optimizer's state in files between steps (engine/zero/nvme.py); the
    #    stage-3 parameter offload wraps outside it (engine/zero/nvme_param.py), so a state dict pages
    #    the shards in before the optimizer state is read back beside them.
    sharding = offload_strategy(sharding, opt, config, rank=comm.get_rank())
    sharding = param_offload_strategy(sharding, config, rank=comm.get_rank())

    # 5. The LR schedule after the optimizer: it records the optimizer's initial learning rates.
    scheduler = _lr_scheduler(lr_scheduler, opt, config)

    # 6. The step sinks: the progress line first (it is what a user watches), then the sinks the
    #    environment names (the worker's heartbeat for script jobs), built after the process group
    #    exists so a factory can ask for its rank.
    # 7. The FLOPs profiler counts the wrapped model (what forward runs) and needs the compute dtype for
    #    the peak; it fills in each step's flops/MFU before the sinks see the record.
    flops = StepFlops.build(model, config, rank=comm.get_rank(), dtype=precision.compute_dtype)
    # 9. MoE gates with auxiliary-loss-free balancing update their biases at each step boundary.
    sinks = [*bias_balancers(model, process_group=process_group), *step_sinks(config)]
    return Training(precision, sharding, opt, scheduler, sinks=sinks, compression=compression,
                    flops=flops, comm_policy=comm_policy, checkpointing=checkpointing)


def _comm_policy(config: Any) -> Any:
    section = getattr(config, "communication", None)
    if section is None or section.compression == "none":
        return None
    from deepfleet.engine.gradcomp.policy import GradientCompression

    return GradientCompression(section)


def step_sinks(config: Any) -> list[StepSink]:
    """The sinks every engine gets, in order: the progress log line, the comms logger and wall-clock
    breakdown when configured, the monitors the config enables (rank 0), then those named by
    DEEPFLEET_STEP_SINKS. Sinks with a `close()` are closed by `engine.destroy()` (or at exit)."""
    rank = comm.get_rank()
    sinks: list[StepSink] = [
        ProgressLog(config.steps_per_print, wall_clock_breakdown=config.wall_clock_breakdown, rank=rank)
    ]
    if config.comms_logger.enabled:
        from deepfleet.engine.profiling.comms_logger import CommsLogger

        sinks.append(CommsLogger(config.comms_logger, steps_per_print=config.steps_per_print, rank=rank,
                                 world_size=comm.get_world_size()))
    if config.wall_clock_breakdown:
        from deepfleet.engine.profiling.breakdown import WallClockBreakdown

        sinks.append(WallClockBreakdown(steps_per_print=config.steps_per_print, rank=rank))
    from deepfleet.engine.monitor.base import build_monitors

    return [*sinks, *build_monitors(config, rank=rank), *sinks_from_env()]


def _compression(model: nn.Module, config: Any, *, process_group: Any) -> Any:
    """`init_compression` (unless the script already called it) and the schedule, for an enabled
    `compression_training` section; None otherwise."""
    section = getattr(config, "compression_training", None)
    if section is None or not (section.techniques() or section.layer_reduction.enabled):
        return None
    from deepfleet.engine.compression.compress import init_compression, is_compressed
    from deepfleet.engine.compression.scheduler import CompressionScheduler

    if not is_compressed(model):
        if section.layer_reduction.enabled:
            raise ValueError(
                "compression_training.layer_reduction: the student must be initialized from its teacher; call "
                "init_compression(model, config, teacher_model=teacher) before initialize()"
            )
        init_compression(model, section)
    return CompressionScheduler(model, process_group=process_group)


def _check_one_source(key: str, configured: Any, given: Any) -> None:
    if configured is not None and given is not None:
        raise ValueError(
            f"{key}: set in the config and passed to initialize(); keep one "
            f"(drop the \"{key}\" section or the {'optimizer' if key == 'optimizer' else 'lr_scheduler'} argument)"
        )


def _check_offload(model: nn.Module, zero_config: Any) -> None:
    """Offloading model states to the CPU is a no-op when training already runs on the CPU (every state
    lives in host memory); NVMe offload moves the optimizer state (engine/zero/nvme.py) and the stage-3
    parameter shards (engine/zero/nvme_param.py) to files.
    On an accelerator both are not implemented yet, and are refused by name rather than silently keeping
    the states on the device."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    optim = getattr(zero_config, "offload_optimizer", None)
    if optim is not None and optim.device == "nvme" and device.type == "cpu":
        check_before_build(optim, model, comm.get_world_size())
    param = getattr(zero_config, "offload_param", None)
    if param is not None and param.device == "nvme" and device.type == "cpu":
        check_param_path(param, model, comm.get_world_size())
    for key in ("offload_optimizer", "offload_param"):
        section = getattr(zero_config, key, None)
        if section is not None and section.device in ("cpu", "nvme") and device.type != "cpu":
            raise ValueError(
                f"zero_optimization.{key}.device: {section.device} offload while training on {device.type} is not "
                f"supported yet; remove zero_optimization.{key} (or set its device to \"none\")"
            )


def _param_groups(model: nn.Module, model_parameters: Any, optimizer: Any) -> list[dict]:
    """The user's param groups as a list of dicts with a "params" list (trainable tensors only)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("optimizer: it has already stepped (it holds state); pass a fresh optimizer")
        source: Any = optimizer.param_groups
    else:
        source = list(model_parameters) if model_parameters is not None else list(model.parameters())
    if not source:
        raise ValueError("model_parameters: empty; pass model.parameters() or a list of param groups")
    if not isinstance(source[0], dict):
        source = [{"params": source}]
    groups = []
    for i, group in enumerate(source):
        if "params" not in group:
            raise ValueError(f"model_parameters[{i}]: a param group needs a \"params\" entry")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        groups.append({**group, "params": [p for p in params if p.requires_grad]})
    return groups


def _optimizer(given: Any, groups: list[dict], config: Any) -> torch.optim.Optimizer:
    if isinstance(given, torch.optim.Optimizer):
        # Re-point the user's own optimizer at the strategy's tensors, so any scheduler the user
        # built on it keeps driving the same param-group dicts.
        if len(given.param_groups) != len(groups):
            raise ValueError(
                "optimizer: its param groups mix expert and dense parameters; build it over "
                "deepfleet.engine.moe.utils.split_params_into_different_moe_groups_for_optimizer(...)"
            )
        for group, mapped in zip(given.param_groups, groups, strict=True):
            group["params"] = list(mapped["params"])
        return given
    if callable(given):
        return given(groups)
    if config.optimizer is None:
        raise ValueError(
            "optimizer: none configured; add an \"optimizer\" section to the config or pass optimizer= "
            "(a torch optimizer or a factory taking param groups)"
        )
    from deepfleet.engine.optim import build_optimizer

    return build_optimizer(groups, config.optimizer)


def _lr_scheduler(given: Any, optimizer: torch.optim.Optimizer, config: Any) -> Any:
    if given is not None:
        # A scheduler object is used as is; anything else callable is a factory taking the optimizer.
        return given if hasattr(given, "step") else given(optimizer)
    if config.scheduler is None:
        return None
    from deepfleet.engine.lr_schedules import build_lr_scheduler

    return build_lr_scheduler(optimizer, config.scheduler)
