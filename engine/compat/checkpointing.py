"""DeepSpeed's activation-checkpointing API (`deepspeed.checkpointing`, also
`deepspeed.runtime.activation_checkpointing.checkpointing`), over `engine/activation_checkpointing.py`.

Callers: model code written for DeepSpeed (Megatron style: `deepspeed.checkpointing.configure(mpu,
deepspeed_config=...)` once, then `deepspeed.checkpointing.checkpoint(layer, hidden, mask)` per layer,
`get_cuda_rng_tracker().fork()` around model-parallel dropout), and `initialize`, which configures this
module from the config's `activation_checkpointing` section when the section is given and the script
has not configured it itself (DeepSpeed's engine and Megatron both call `configure` with that section).

DeepSpeed's API is process-global (configure once, then call `checkpoint` from any layer), so the
settings live in one module-level `_Settings`; `configure` replaces them whole, as DeepSpeed's does.
The options keep DeepSpeed's meanings (see `config_activation_checkpointing.ActivationCheckpointingConfig`):
`checkpoint_in_cpu` keeps each checkpoint's inputs in host memory; `synchronize` synchronizes the
accelerator around each checkpoint's forward and backward; `profile` logs each call's forward and backward
seconds. `partition_activations` splits the saved inputs over the model-parallel ranks: at model-parallel
size 1, the only size an engine here trains at, the partition is the whole tensor, so it is accepted and
keeps everything as it is; an mpu reporting a larger size is refused ("not supported yet").
`contiguous_checkpointing`/`num_checkpoints` choose a buffer layout and its size, not what is kept or
computed; they are validated as DeepSpeed does and change nothing else.

The RNG tracker is Megatron's contract (named RNG states forked around model-parallel regions). Torch's
checkpoint restores the default CPU and device generators for the recomputation; the tracker's named
states are restored too (a context around the recomputation), so dropout under `fork()` replays the same
mask.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from deepfleet.engine.activation_checkpointing import checkpoint_call

logger = logging.getLogger(__name__)

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


@dataclass
class _Settings:
    configured: bool = False
    mpu: Any = None
    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: int | None = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False


_SETTINGS = _Settings()


def _section(deepspeed_config: Any) -> Any:
    """The `activation_checkpointing` section of a DeepSpeed config (dict, path, JSON string, a loaded
    DeepFleetConfig or DeepSpeedConfig); only that section is validated, its errors named by key."""
    from deepfleet.engine.config import ConfigError, DeepFleetConfig, load_config
    from deepfleet.engine.config_source import read_source

    loaded = getattr(deepspeed_config, "config", deepspeed_config)  # a DeepSpeedConfig holds the parse
    if isinstance(loaded, DeepFleetConfig):
        return loaded.activation_checkpointing
    errors: list[str] = []
    raw = read_source(deepspeed_config, errors)
    if raw is None:
        raise ConfigError(errors)
    section = raw.get("activation_checkpointing", {})
    return load_config({"train_batch_size": 1, "activation_checkpointing": section}).activation_checkpointing


def _model_parallel_size(mpu: Any) -> int:
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        size = getattr(mpu, name, None)
        if callable(size):
            return int(size())
    return 1


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Configure `checkpoint`: defaults, then the config's `activation_checkpointing` section, then the
    keyword arguments that are not None. Raises ValueError (ConfigError for the config) naming the key."""
    settings = _Settings(configured=True, mpu=mpu_)
    if deepspeed_config is not None:
        section = _section(deepspeed_config)
        settings.partition_activations = section.partition_activations
        settings.contiguous_checkpointing = section.contiguous_memory_optimization
        settings.num_checkpoints = section.number_checkpoints
        settings.checkpoint_in_cpu = section.cpu_checkpointing
        settings.synchronize = section.synchronize_checkpoint_boundary
        settings.profile = section.profile
    given = {"partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
             "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu,
             "synchronize": synchronize, "profile": profile}
    for name, value in given.items():
        if value is not None:
            setattr(settings, name, value)
    if settings.contiguous_checkpointing and not settings.partition_activations:
        raise ValueError("contiguous_checkpointing: needs partition_activations=True (as in DeepSpeed); set it or "
                         "drop contiguous_checkpointing")
    if settings.contiguous_checkpointing and settings.num_checkpoints is None:
        raise ValueError("contiguous_checkpointing: needs num_checkpoints (checkpoints per forward); pass it")
    mp = _model_parallel_size(mpu_) if mpu_ is not None else 1
    if settings.partition_activations and mp > 1:
        raise ValueError(f"partition_activations: partitioning over {mp} model-parallel ranks is not supported yet; "
                         "set partition_activations to false")
    global _SETTINGS
    _SETTINGS = settings
    logger.debug("activation checkpointing configured: %s", settings)


def configure_from_engine_config(config: Any) -> None:
    """What `initialize` calls: configure from the config's `activation_checkpointing` section when it was
    given and the script has not called `configure` itself (the script's call is the explicit one)."""
    if "activation_checkpointing" in config.model_fields_set and not _SETTINGS.configured:
        configure(None, deepspeed_config=config)


def is_configured() -> bool:
    """True once `configure` ran (DeepSpeed's switch for Megatron to use this API's checkpoint)."""
    return _SETTINGS.configured


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here (between evaluation forwards); torch's
    checkpoint holds no buffers between calls, so there is nothing to free."""


def set_num_layers(nlayers: int) -> None:
    """DeepSpeed's setter of `num_checkpoints`."""
    _SETTINGS.num_checkpoints = nlayers


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    """DeepSpeed's setter of `partition_activations` (see the module docstring for its effect)."""
    mp = _model_parallel_size(_SETTINGS.mpu) if _SETTINGS.mpu is not None else 1
    if partition_activation and mp > 1:
        raise ValueError(f"partition_activations: partitioning over {mp} model-parallel ranks is not supported yet")
    _SETTINGS.partition_activations = partition_activation


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`function(*args, **kwargs)`, its activations recomputed in backward (DeepSpeed's `checkpoint`)."""
    settings = _SETTINGS
    if settings.synchronize:
        _synchronize()
    start = time.perf_counter()
    snapshot: dict[str, torch.Tensor] = {}
    timing: dict[str, float] = {}
    out = checkpoint_call(function, *args, offload=settings.checkpoint_in_cpu,
                          context_fn=lambda: (_tracker_snapshot(snapshot), _tracker_replay(snapshot, timing)),
                          **kwargs)
    if settings.synchronize:
        _synchronize()
    if settings.profile:
        logger.info("activation checkpoint forward: %.3f ms", (time.perf_counter() - start) * 1e3)
    if settings.profile or settings.synchronize:
        _at_end_of_backward(args, kwargs, settings=settings, timing=timing)
    return out


non_reentrant_checkpoint = checkpoint
"""DeepSpeed's name of the non-reentrant variant; `checkpoint` here is non-reentrant already."""


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _at_end_of_backward(args: tuple, kwargs: dict, *, settings: _Settings, timing: dict[str, float]) -> None:
    """Synchronize and log this call's backward seconds (from the start of its recomputation) once the
    gradients of all its inputs that need one are computed; no hook when none needs a gradient."""
    inputs = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not inputs:
        return

    def done(_grads: Any) -> None:
        if settings.synchronize:
            _synchronize()
        if settings.profile and "recompute" in timing:
            logger.info("activation checkpoint backward: %.3f ms", (time.perf_counter() - timing["recompute"]) * 1e3)

    torch.autograd.graph.register_multi_grad_hook(inputs, done, mode="all")


# --------------------------------------------------------------------------- Megatron's RNG tracker


class CudaRNGStatesTracker:
    """Named accelerator RNG states (Megatron's tracker): `add(name, seed)`, then `with fork(name):` runs
    with that state and keeps its advance, leaving the default generator as it was."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track a new state seeded with `seed`; raises ValueError for a seed or name already used."""
        from deepfleet.engine.compat.accelerator import get_accelerator

        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists; use another seed")
        if name in self.states_:
            raise ValueError(f"rng state {name!r} already exists; use another name")
        self.seeds_.add(seed)
        accel = get_accelerator()
        before = accel.get_rng_state()
        accel.manual_seed(seed)
        self.states_[name] = accel.get_rng_state()
        accel.set_rng_state(before)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the body with state `name`; raises ValueError when it was never added."""
        from deepfleet.engine.compat.accelerator import get_accelerator

        if name not in self.states_:
            raise ValueError(f"rng state {name!r} is not added; call get_cuda_rng_tracker().add(name, seed) first")
        accel = get_accelerator()
        before = accel.get_rng_state()
        accel.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = accel.get_rng_state()
            accel.set_rng_state(before)


_RNG_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's tracker (Megatron's `get_cuda_rng_tracker`)."""
    return _RNG_TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with `seed` (the same on every model-parallel rank of a data-parallel
    replica) and the tracker's model-parallel state with `seed + 2718 + tensor-parallel rank`, Megatron's
    offsets. The tensor-parallel rank comes from the configured mpu (0 without one)."""
    from deepfleet.engine.compat.accelerator import get_accelerator

    mpu = _SETTINGS.mpu
    rank_of = getattr(mpu, "get_tensor_model_parallel_rank", None) or getattr(mpu, "get_model_parallel_rank", None)
    tp_rank = int(rank_of()) if callable(rank_of) else 0
    _RNG_TRACKER.reset()
    get_accelerator().manual_seed(seed)
    _RNG_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)


@contextlib.contextmanager
def _tracker_snapshot(snapshot: dict[str, torch.Tensor]) -> Iterator[None]:
    """Around the forward: record the tracker's states at its start (into `snapshot`)."""
    snapshot.update(_RNG_TRACKER.get_states())
    yield


@contextlib.contextmanager
def _tracker_replay(snapshot: dict[str, torch.Tensor], timing: dict[str, float]) -> Iterator[None]:
    """Around the recomputation: the tracker's states of the forward, then the current ones back."""
    timing["recompute"] = time.perf_counter()
    if _SETTINGS.synchronize:
        _synchronize()
    current = _RNG_TRACKER.get_states()
    _RNG_TRACKER.set_states(dict(snapshot))
    try:
        yield
    finally:
        _RNG_TRACKER.set_states(current)
