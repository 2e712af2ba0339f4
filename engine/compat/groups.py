"""`deepspeed.utils.groups`: the process groups of the running engine, under DeepSpeed's accessor names.

`engine.initialize` registers its `ParallelDims` here (`set_parallel`); the accessors answer from it
(the data-parallel, expert-parallel, expert-data-parallel, sequence-parallel and model-parallel groups,
sizes and ranks). Before any engine exists they answer for the whole world (DeepSpeed's behaviour with no
model parallelism), which is what scripts that call them before `initialize` expect. DeepSpeed keys
expert groups by name (`"ep_size_2"`); there is one expert-parallel layout per engine here, so every
name gets it.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

_CURRENT: list[Any] = []  # the ParallelDims of the last engine built in this process


def set_parallel(parallel: Any) -> None:
    """Called by `engine.initialize` with the engine's `ParallelDims`."""
    _CURRENT[:] = [parallel]


def _parallel() -> Any:
    return _CURRENT[0] if _CURRENT else None


def _sub(name: str, *, alone_if_missing: bool = False) -> Any:
    """The process group of sub-mesh `name`; without it, this rank alone (a size-1 axis of the mesh) when
    `alone_if_missing` (an expert-parallel group at ep 1), else the data-parallel group."""
    parallel = _parallel()
    if parallel is None or getattr(parallel, "mesh", None) is None:
        return dist.group.WORLD
    try:
        return parallel.submesh(name).get_group()
    except KeyError:
        if alone_if_missing:
            for axis in ("tp", "sp", "pp"):
                if getattr(parallel, axis) == 1:
                    return parallel.submesh(axis).get_group()
        return parallel.dp_group


def _get_data_parallel_group() -> Any:
    parallel = _parallel()
    return parallel.dp_group if parallel is not None else dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size(_get_data_parallel_group()) if dist.is_initialized() else 1


def _get_data_parallel_rank() -> int:
    return dist.get_rank(_get_data_parallel_group()) if dist.is_initialized() else 0


def _get_broadcast_src_rank() -> int:
    """The global rank of data-parallel rank 0 in this rank's data-parallel group."""
    return dist.get_global_rank(_get_data_parallel_group(), 0) if dist.is_initialized() else 0


def _get_expert_parallel_group(group_name: str = "") -> Any:
    return _sub("ep", alone_if_missing=True)


def _get_expert_data_parallel_group(group_name: str = "") -> Any:
    return _sub("dp_mod_ep")


def _get_expert_parallel_world_size(group_name: str = "") -> int:
    return dist.get_world_size(_get_expert_parallel_group(group_name)) if dist.is_initialized() else 1


def _get_expert_parallel_rank(group_name: str = "") -> int:
    return dist.get_rank(_get_expert_parallel_group(group_name)) if dist.is_initialized() else 0


def _get_sequence_parallel_group() -> Any:
    return _sub("sp")


def _get_sequence_parallel_world_size() -> int:
    parallel = _parallel()
    return parallel.sp if parallel is not None else 1


def _get_sequence_parallel_rank() -> int:
    return dist.get_rank(_get_sequence_parallel_group()) if dist.is_initialized() and _get_sequence_parallel_world_size() > 1 else 0


def _get_model_parallel_world_size() -> int:
    parallel = _parallel()
    return parallel.tp if parallel is not None else 1


def _get_model_parallel_rank() -> int:
    return dist.get_rank(_sub("tp")) if dist.is_initialized() and _get_model_parallel_world_size() > 1 else 0


def get_tensor_model_parallel_world_size() -> int:
    return _get_model_parallel_world_size()


def get_tensor_model_parallel_rank() -> int:
    return _get_model_parallel_rank()
