"""Weights for `init_inference(checkpoint=...)`: a deepfleet training checkpoint or a safetensors file.

Called by `engine.InferenceEngine` before the model is cast and converted. A training checkpoint is
read directly, with no export step: `path` is a checkpoint root (its `latest` complete step, or the
newest complete one) or one step directory; the model tensors are DCP entries `model.<fqn>`, and DCP
reassembles each full tensor from however many ranks wrote it and at whatever ZeRO stage, so a
checkpoint saved at any world size loads in one process (`no_dist`, as `checkpoint/export.py` reads
it). A tensor-parallel engine loads the full weights on every rank and cuts its shard afterwards.

Names: the saved FQNs are the training module's (e.g. the example's `GPTWithLoss` saves `gpt.tok.weight`);
the model given to init_inference may be that module or the one inside it, so a common leading prefix
(`gpt.`, `module.`, `model.`) is matched. Missing or mis-shaped tensors raise ValueError listing them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from deepfleet.engine.checkpoint import layout
from deepfleet.engine.checkpoint.io import StepReader
from deepfleet.engine.checkpoint.layout import CheckpointError

MODEL_PREFIX = "model."


def step_dir_of(path: Path) -> Path:
    """`path` itself when it is a step directory, else the complete step a root points to."""
    if not path.is_dir():
        raise ValueError(f"checkpoint: {path} is neither a .safetensors file nor a checkpoint directory")
    if any((path / name).exists() for name in (layout.MANIFEST, layout.COMPLETE, ".metadata")):
        return path
    tag = layout.find_latest_complete(path)
    if tag is None:
        raise ValueError(f"checkpoint: {path} holds no complete checkpoint (no step directory with a COMPLETE marker)")
    return path / tag


def _match(wanted: list[str], saved: set[str]) -> dict[str, str]:
    """model key -> saved key, trying the prefixes a training wrapper may have added or removed."""
    candidates = {""} | {k.split(".", 1)[0] + "." for k in saved if "." in k}
    best: dict[str, str] = {}
    for prefix in sorted(candidates):
        found = {k: prefix + k for k in wanted if prefix + k in saved}
        found.update({k: k[len(prefix):] for k in wanted if k.startswith(prefix) and k[len(prefix):] in saved})
        if len(found) > len(best):
            best = found
    return best


def _assign(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    state = model.state_dict(keep_vars=True)
    names = _match(list(state), set(tensors))
    shared = {}
    for name, t in state.items():  # tied weights: one saved copy fills every name sharing its storage
        shared.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    problems = []
    with torch.no_grad():
        for ptr_names in shared.values():
            hit = next((n for n in ptr_names if n in names), None)
            if hit is None:
                problems.append(f"{ptr_names[0]} is not in {source}")
                continue
            value = tensors[names[hit]]
            for n in ptr_names:
                if tuple(state[n].shape) != tuple(value.shape):
                    problems.append(f"{n} has shape {list(value.shape)} in {source}, {list(state[n].shape)} in the model")
                else:
                    state[n].copy_(value)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"checkpoint: does not fit the model: {'; '.join(problems[:3])}{more}")


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Copy the weights at `path` into `model` in place (see the module docstring)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        if not path.is_file():
            raise ValueError(f"checkpoint: {path}: no such file")
        from safetensors.torch import load_file

        _assign(model, load_file(path), str(path))
        return
    step_dir = step_dir_of(path)
    try:
        reader = StepReader(step_dir)
        saved = {k: v for k, v in reader.saved_shapes().items() if k.startswith(MODEL_PREFIX)}
    except CheckpointError as e:
        raise ValueError(f"checkpoint: {e}") from e
    if not saved:
        raise ValueError(f"checkpoint: {step_dir} holds no model tensors")
    wanted = _match(list(model.state_dict()), {k[len(MODEL_PREFIX):] for k in saved})
    tensors = {MODEL_PREFIX + key: torch.empty(saved[MODEL_PREFIX + key][0], dtype=saved[MODEL_PREFIX + key][1])
               for key in wanted.values()}
    with warnings.catch_warnings():
        # One plain process reading the shards is the intent; DCP warns about it unconditionally.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(tensors, checkpoint_id=step_dir, no_dist=True)
    _assign(model, {k[len(MODEL_PREFIX):]: v for k, v in tensors.items()}, str(step_dir))
