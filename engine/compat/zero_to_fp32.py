"""`deepspeed.utils.zero_to_fp32`: consolidated fp32 weights from a sharded checkpoint, offline.

DeepSpeed needs this script because its ZeRO checkpoints are per-rank partitions; this engine's
checkpoints are topology-independent already (`torch.distributed.checkpoint` with global shapes), so the
functions here only read the `model.*` tensors of a complete step directory in one process, in fp32 (the
safetensors exporter, `deepfleet.engine.checkpoint.export`, is the streaming route for large models).
`checkpoint_dir` is the directory `save_checkpoint` was given; `tag` defaults to its `latest`.
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch
from torch import nn

from deepfleet.engine.checkpoint import layout
from deepfleet.engine.checkpoint.export import MODEL_PREFIX, _load_partial
from deepfleet.engine.checkpoint.io import StepReader
from deepfleet.engine.checkpoint.layout import CheckpointError


def _step_dir(checkpoint_dir: str | Path, tag: str | None) -> Path:
    root = Path(checkpoint_dir)
    if tag is None:
        tag = layout.read_latest(root) or layout.find_latest_complete(root)
        if tag is None:
            raise CheckpointError(f"{root}: no complete checkpoint (no 'latest' file and no COMPLETE step); pass tag=")
    return root / layout.validate_tag(str(tag))


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | Path, tag: str | None = None, exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The model's full state dict in fp32 (floating tensors cast; integer buffers keep their dtype),
    keyed by the model's parameter names. Raises CheckpointError for a missing or incomplete step."""
    if exclude_frozen_parameters:
        raise ValueError("exclude_frozen_parameters: checkpoints keep every parameter; filter the returned dict")
    if lazy_mode:
        raise ValueError("lazy_mode: not supported; the tensors are loaded eagerly")
    step_dir = _step_dir(checkpoint_dir, tag)
    reader = StepReader(step_dir)
    reader.verify()
    shapes = {k: v for k, v in reader.saved_shapes().items() if k.startswith(MODEL_PREFIX)}
    if not shapes:
        raise CheckpointError(f"{step_dir}: holds no model tensors")
    tensors = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
    _load_partial(tensors, step_dir)
    return collections.OrderedDict(
        (k[len(MODEL_PREFIX):], t.float() if t.is_floating_point() else t) for k, t in sorted(tensors.items())
    )


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | Path, output_dir: str | Path, max_shard_size: str = "5GB",
    safe_serialization: bool = False, tag: str | None = None, exclude_frozen_parameters: bool = False,
) -> Path:
    """Write the fp32 state dict into `output_dir` as `pytorch_model.bin` (or `model.safetensors` with
    `safe_serialization`), one file; returns its path."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if safe_serialization:
        from safetensors.torch import save_file

        path = out_dir / "model.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
    else:
        path = out_dir / "pytorch_model.bin"
        torch.save(dict(state), path)
    return path


def load_state_dict_from_zero_checkpoint(model: nn.Module, checkpoint_dir: str | Path, tag: str | None = None) -> nn.Module:
    """Load the checkpoint's fp32 weights into `model` (strict) and return it."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model.load_state_dict(state, strict=True)
    return model
