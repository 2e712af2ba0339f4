"""`deepspeed.runtime.utils` helpers scripts call (`set_random_seed`, `see_memory_usage`,
`move_to_device`) and `deepspeed.checkpoint.utils.clone_tensors_for_torch_save`."""

from __future__ import annotations

import gc
import logging
import random
from collections.abc import Callable
from typing import Any

import torch

from deepfleet.engine.compat.accelerator import get_accelerator


def set_random_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators (all devices)."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log the device's allocated/peak memory and the host's, in GB (only with `force`, as DeepSpeed)."""
    if not force:
        return
    import psutil

    from deepfleet.engine.compat.logging import log_dist

    gc.collect()
    acc = get_accelerator()
    gib = 1024**3
    vm = psutil.virtual_memory()
    log_dist(message, ranks=[0])
    log_dist(f"MA {acc.memory_allocated() / gib:.2f} GB  Max_MA {acc.max_memory_allocated() / gib:.2f} GB", ranks=[0])
    log_dist(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / gib:.2f} GB, percent = {vm.percent}%",
             ranks=[0], level=logging.INFO)
    acc.reset_peak_memory_stats()


def move_to_device(item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """`item` with every tensor (or every object `criterion_func` accepts) moved to `device`,
    through lists, tuples and dicts."""
    accept = criterion_func or torch.is_tensor
    if accept(item):
        return item.to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = torch.device("cpu")) -> Any:
    """A copy of `item` whose tensors are detached clones on `device` (views no longer share storage
    with large buffers, so `torch.save` writes only their own bytes)."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
