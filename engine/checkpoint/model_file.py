"""The 16-bit model file: `engine.save_16bit_model(save_dir, save_filename="pytorch_model.bin")`.

Called by `DeepFleetEngine.save_16bit_model` / `save_fp16_model` and
`_zero3_consolidated_16bit_state_dict` (the names HF Trainer and Accelerate call). DeepSpeed's
meaning, on our strategies: the file is a bare `state_dict` of the user's model in the training
compute dtype (bf16/fp16, or fp32 when training in fp32), written by rank 0 with `torch.save`, so
`model.load_state_dict(torch.load(path))` works without deepfleet. Every rank must call it.

- Parameters replicated (stages 0-2): the module's own state dict, as it runs.
- Parameters sharded (stage 3, DTensor parameters): the full weights exist on no rank, so they are
  gathered only when `zero_optimization.stage3_gather_16bit_weights_on_model_save` is true
  (gathering costs a full model copy in host memory on rank 0, hence not the default); otherwise
  nothing is written and the call returns False, as DeepSpeed does, since a file of shards would
  not load. The gather is torch's `get_model_state_dict(full_state_dict=True, cpu_offload=True)`,
  and floating-point tensors are cast to the compute dtype (FSDP2 keeps fp32 shards and casts per
  forward), so the file is the same at every stage.

Each tensor is cloned before saving (a view would drag its whole flat buffer into the file), with
tensors that share memory (tied weights) kept shared.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from deepfleet.engine import comm
from deepfleet.engine.autotp import gather_full_state

logger = logging.getLogger(__name__)


def partitions_weights(module: nn.Module) -> bool:
    """Whether the module's parameters are shards (no rank holds the full weights)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def _frozen(module: nn.Module) -> set[str]:
    return {name for name, p in module.named_parameters() if not p.requires_grad}


def _portable(state: dict[str, torch.Tensor], *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """CPU copies in `dtype` (floating-point tensors only), one copy per shared piece of memory."""
    copies: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if key not in copies:
            target = dtype if t.is_floating_point() else t.dtype
            copies[key] = t.detach().to(device="cpu", dtype=target, copy=True)
        out[name] = copies[key]
    return out


def consolidated_16bit_state_dict(
    module: nn.Module, *, dtype: torch.dtype, exclude_frozen_parameters: bool = False
) -> dict[str, torch.Tensor] | None:
    """The full state dict of a module with sharded parameters, on rank 0 (None on the other ranks).
    Collective: every rank of the module's mesh must call it."""
    if not partitions_weights(module):
        raise ValueError("_zero3_consolidated_16bit_state_dict: needs ZeRO stage 3 (sharded parameters); "
                         "use engine.module.state_dict() at stages 0-2")
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if comm.get_rank() != 0:
        return None
    frozen = _frozen(module) if exclude_frozen_parameters else set()
    return _portable({k: v for k, v in state.items() if k not in frozen}, dtype=dtype)


def save_16bit_model(
    module: nn.Module,
    save_dir: str | Path,
    save_filename: str = "pytorch_model.bin",
    *,
    dtype: torch.dtype,
    gather_sharded: bool,
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Write `<save_dir>/<save_filename>`; True when written, False when the weights are sharded and
    `gather_sharded` (stage3_gather_16bit_weights_on_model_save) is off. Every rank must call it."""
    path = Path(save_dir) / save_filename
    state: dict[str, Any] | None
    if partitions_weights(module):
        if not gather_sharded:
            logger.warning(
                "did not save %s: the weights are sharded (ZeRO stage 3) and "
                "zero_optimization.stage3_gather_16bit_weights_on_model_save is false; set it to true", path
            )
            return False
        state = consolidated_16bit_state_dict(module, dtype=dtype, exclude_frozen_parameters=exclude_frozen_parameters)
    else:
        frozen = _frozen(module) if exclude_frozen_parameters else set()
        whole = gather_full_state(module, module.state_dict())  # tensor-parallel shares made whole (collective)
        state = _portable({k: v for k, v in whole.items() if k not in frozen}, dtype=dtype)
    if comm.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        logger.info("saved 16-bit model weights to %s", path)
    if comm.get_world_size() > 1:
        comm.barrier()  # the file is complete on every rank's return
    return True
