"""Process-group setup for the engine: `init_distributed` (public, DeepSpeed-shaped) and the device
each rank trains on.

Called by `engine.initialize` (and by user scripts that want the group before building their model).
torchrun/torch.distributed.elastic exports RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, so `env://` is the
only rendezvous we need; gloo on CPU, nccl when CUDA is present. A plain `python train.py` without
those variables gets a one-rank group over an in-memory store, so every ZeRO strategy can rely on
a process group (DDP and FSDP2 require one) without opening a port.

A default group the engine creates (either way) is also destroyed by the engine at interpreter exit,
unless the script destroyed it first: a gloo group left alive into interpreter finalization can
still hold pending work whose tensors need the GIL, which aborts the finished process
("terminate called without an active exception", exit -6) - pytorch#190489.
"""

from __future__ import annotations

import atexit
import datetime
import os

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def _env_world_size() -> int | None:
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def init_distributed(
    dist_backend: str | None = None,
    *,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Join the process group described by the environment (torchrun's env://), or by `init_method`
    with explicit `rank` and `world_size`.

    A no-op when a group already exists, or when neither WORLD_SIZE nor an explicit world size is
    given (a single process; see `ensure_process_group`). `dist_backend` defaults to nccl with CUDA,
    gloo otherwise. Raises ValueError when the environment is half set."""
    explicit = world_size >= 0
    if dist.is_initialized() or (_env_world_size() is None and not explicit):
        return
    if explicit and rank < 0:
        raise ValueError("rank: required with world_size; pass both, or neither to use the environment")
    needed = ("MASTER_ADDR", "MASTER_PORT") if explicit else ("RANK", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in needed if k not in os.environ] if init_method is None else []
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not set; launch with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR "
            "and MASTER_PORT, or pass init_method="
        )
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    placement = {"rank": rank, "world_size": world_size} if explicit else {}
    dist.init_process_group(backend, init_method=init_method or "env://", timeout=timeout, **placement)
    _destroy_at_exit()


def ensure_process_group(*, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
    """`init_distributed()`, then, if still alone, a one-rank group (nccl with CUDA, else gloo) on an
    in-memory store."""
    init_distributed(timeout=timeout)
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        _destroy_at_exit()


def _destroy_at_exit() -> None:
    # The id, not the group: a reference held by the hook would keep the group alive.
    atexit.register(_destroy_own_group, id(dist.group.WORLD))


def _destroy_own_group(group_id: int) -> None:
    """Destroy the default group the engine made, unless the script already destroyed it."""
    if dist.is_initialized() and id(dist.group.WORLD) == group_id:
        dist.destroy_process_group()


def training_device() -> torch.device:
    """This rank's device: cuda:LOCAL_RANK when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
