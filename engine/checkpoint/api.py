"""`save_checkpoint(engine, dir)` / `load_checkpoint(engine, dir)`: what the engine's methods call.

`DeepFleetEngine.save_checkpoint/load_checkpoint` delegate here (lazily, so the engine imports DCP
only when it checkpoints). Return values follow DeepSpeed: save returns True; load returns
`(path, client_state)`, or `(None, None)` when the directory holds no complete checkpoint.

What this reads from the engine (duck-typed, so the engine never needs a checkpoint-specific API):
- `engine.sharding`: the ZeroStrategy; its `state_dict()` / `load_state_dict()` carry model and
  optimizer state in DCP's format (sharded DTensors or plain tensors, keyed by the model's FQNs);
- `engine.global_steps`, `engine.micro_steps` (ints; on load `micro_steps` restarts at the boundary of the
  current accumulation count, which changes with the world size), `engine.global_samples` if present;
- `engine.lr_scheduler`, `engine.precision` (loss scaler), `engine.training_dataloader`: each
  optional, saved through its `state_dict()` and restored through `load_state_dict()`. The data
  loader's state must be world-size independent (global samples consumed, epoch, seed) so a resume at
  another world size with the same global batch continues with the same batches;
- `engine.config`: `zero_optimization.stage` and a hash of the config, recorded in the manifest;
- `engine.optimizer.comm_state_dict()` / `load_comm_state_dict()` when it has them (the 1-bit optimizers'
  error feedback): saved in each rank's own file, restored at the same world size, reset (and logged)
  at another.

Loading reshards to the current world size and ZeRO stage with no offline step (DCP maps between
layouts); a checkpoint that does not fit raises CheckpointError before any tensor is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import weakref
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from deepfleet.engine import comm
from deepfleet.engine.checkpoint import layout
from deepfleet.engine.checkpoint.io import StepReader, StepWriter
from deepfleet.engine.checkpoint.layout import CheckpointError
from deepfleet.engine.checkpoint.state import (
    ENGINE_STATE,
    capture_rng,
    derived_rng_seed,
    restore_rng,
    seed_all,
)

log = logging.getLogger(__name__)

# One writer per engine (it owns a process group and the in-flight async save); dropped with the engine.
_WRITERS: weakref.WeakKeyDictionary[Any, StepWriter] = weakref.WeakKeyDictionary()

_OPTIONAL_STATEFUL = ("lr_scheduler", "precision", "training_dataloader", "compression", "model_schedules",
                      "privacy")


def _tp_wrapped(engine: Any, state: dict) -> dict:
    """`state` with tensor-parallel shares as whole-shaped 2-D DTensors (engine/autotp.py); unchanged
    without tensor parallelism."""
    mesh = getattr(engine, "tp_checkpoint_mesh", None)
    return mesh.wrap_state(state, engine.module) if mesh is not None else state


def _check_tp_degree(engine: Any, reader: StepReader) -> None:
    """Fused tensor-parallel weights are saved in the share order of their tp degree: refuse another."""
    from deepfleet.engine.autotp import fused_layers

    parallel = getattr(engine, "parallel", None)
    saved = (reader.manifest.degrees or {}).get("tp", 1)
    now = parallel.tp if parallel is not None else 1
    if saved == now:
        return
    fused = fused_layers(engine.module) if now > 1 else []
    saved_fused = reader.manifest.tp_fused
    if saved_fused is None:  # an older checkpoint: only the built-in rules' names tell
        saved_fused = ["qkv-style layers"] if saved > 1 and _has_fused_names(reader) else []
    if fused or saved_fused:
        raise CheckpointError(
            f"tensor_parallel.autotp_size: the checkpoint was saved at tp {saved}, this run is at tp {now}, and "
            f"its fused weights ({', '.join((fused or saved_fused)[:3])}) are stored in the order of that "
            f"degree; resume with autotp_size {saved if saved > 1 else 0}")


def _fused_at_save(engine: Any, parallel: Any) -> list[str]:
    if parallel is None or parallel.tp <= 1:
        return []
    from deepfleet.engine.autotp import fused_layers

    return fused_layers(engine.module)


def _has_fused_names(reader: StepReader) -> bool:
    from deepfleet.engine.autotp import _DEFAULT_RULES

    fused = [re.compile(p) for p, kind, blocks in _DEFAULT_RULES if blocks > 1]
    return any(p.search(k) for k in reader.saved_shapes() if k.startswith("model.") for p in fused)


def writer_for(engine: Any) -> StepWriter:
    """The engine's checkpoint writer, created on first use (a collective: every rank calls save)."""
    writer = _WRITERS.get(engine)
    if writer is None:
        writer = _WRITERS[engine] = StepWriter()
    return writer


def save_checkpoint(
    engine: Any,
    save_dir: str | Path,
    *,
    tag: str | None = None,
    client_state: dict | None = None,
    save_latest: bool = True,
    async_save: bool = False,
    keep_last: int | None = None,
) -> bool:
    """Save the engine's full training state under `<save_dir>/<tag>/` (tag defaults to global_step<N>).

    Every rank must call it. With `async_save`, it returns once the state is staged in memory and the
    shards are written while training continues; the directory becomes loadable (COMPLETE) when done,
    and the next save or load waits for it. `keep_last` deletes older complete checkpoints beyond that
    count. Raises CheckpointError for a bad tag or a failed write.
    """
    tag = layout.validate_tag(tag if tag is not None else layout.default_tag(int(engine.global_steps)))
    _validate_tag_across_ranks(engine, tag)
    writer = writer_for(engine)
    shared = {
        "global_steps": int(engine.global_steps),
        "micro_steps": int(engine.micro_steps),
        "global_samples": int(getattr(engine, "global_samples", 0) or 0),
        "client_state": client_state if client_state is not None else {},
    }
    for name in _OPTIONAL_STATEFUL:
        obj = getattr(engine, name, None)
        if obj is not None and hasattr(obj, "state_dict"):
            shared[name] = obj.state_dict()
    world = comm.get_world_size()
    parallel = getattr(engine, "parallel", None)
    writer.save(
        Path(save_dir) / tag,
        tensors=_tp_wrapped(engine, engine.sharding.state_dict()),
        rank_state={"rank": _rank(), "world_size": world, "rng": capture_rng(), **_comm_state(engine)},
        shared_state=shared,
        manifest_fields={
            "global_steps": int(engine.global_steps),
            "micro_steps": int(engine.micro_steps),
            "world_size": world,
            "degrees": parallel.degrees() if parallel is not None else None,
            "tp_fused": _fused_at_save(engine, parallel),
            "zero_stage": _zero_stage(engine),
            "config_hash": config_hash(getattr(engine, "config", None)),
            "deepfleet_version": _version("deepfleet"),
            "torch_version": torch.__version__,
        },
        async_save=async_save,
        keep_last=keep_last,
        update_latest=save_latest,
    )
    return True


def _validate_tag_across_ranks(engine: Any, tag: str) -> None:
    """`checkpoint.tag_validation`: every rank must save under the same tag (one all_gather_object)."""
    section = getattr(getattr(engine, "config", None), "checkpoint", None)
    mode = getattr(section, "tag_validation", "Warn")
    if mode == "Ignore" or comm.get_world_size() == 1:
        return
    tags: list[Any] = [None] * comm.get_world_size()
    comm.all_gather_object(tags, tag)
    if len(set(tags)) > 1:
        message = f"checkpoint tag differs across ranks: {sorted(set(tags))}; pass every rank the same tag"
        if mode == "Fail":
            raise CheckpointError(f"checkpoint.tag_validation=Fail: {message}")
        log.warning("checkpoint.tag_validation=Warn: %s", message)


def wait_for_checkpoint(engine: Any) -> None:
    """Block until the engine's in-flight async save is complete (re-raising its error, if any)."""
    writer = _WRITERS.get(engine)
    if writer is not None:
        writer.wait()


def load_checkpoint(
    engine: Any,
    load_dir: str | Path,
    *,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    load_module_strict: bool = True,
) -> tuple[str | None, dict | None]:
    """Restore the engine from `<load_dir>/<tag>` (default: the newest complete checkpoint).

    `load_module_strict=False` (DeepSpeed's meaning): model tensors the checkpoint lacks keep their
    current values and checkpoint tensors the model lacks are ignored; shapes of the shared ones must
    still match.

    Returns `(step_dir, client_state)`, or `(None, None)` when there is nothing to load. A given `tag`
    must name a complete checkpoint. Raises CheckpointError for an interrupted, corrupted, too-new or
    mismatched checkpoint, on every rank, before any state is changed.
    """
    wait_for_checkpoint(engine)
    root = Path(load_dir)
    if tag is None:
        tag = layout.find_latest_complete(root)
        if tag is None:
            log.info("no complete checkpoint under %s; starting from scratch", root)
            return None, None
    step_dir = root / layout.validate_tag(tag)
    if not step_dir.is_dir():
        raise CheckpointError(f"{step_dir}: no such checkpoint directory")
    reader = StepReader(step_dir, group=writer_for(engine).group)
    reader.verify()

    with_optim = load_optimizer_states and not load_module_only
    state = engine.sharding.state_dict()
    if not load_module_strict and with_optim:
        saved_model = {k for k in reader.saved_shapes() if k.startswith("model.")}
        if saved_model != {f"model.{k}" for k in _flat_keys(state["model"])}:
            # the optimizer's param groups list the saved model's parameters: they cannot be mapped
            log.warning("load_module_strict=False: the model's parameters differ from the checkpoint's, "
                        "so the optimizer state is not loaded (fresh optimizer state)")
            with_optim = False
    if with_optim:
        _complete_optimizer_template(state, reader.saved_shapes())
    _check_tp_degree(engine, reader)
    # tensor-parallel shares as whole-shaped DTensors sharing their storage: DCP fills them in place
    template = _tp_wrapped(engine, state)
    wanted = template if with_optim else {"model": template["model"]}
    if not load_module_strict:  # the same tensors: DCP fills the shared ones in place, the rest stay
        wanted = _only_saved(wanted, reader.saved_shapes())
    reader.check_shapes(wanted, strict_prefixes=("model.",) if load_module_strict else ())
    shared = reader.shared_state()
    if not load_module_only:
        # First: these may refuse the checkpoint (a data loader seeded differently) before tensors change.
        skip = set() if load_lr_scheduler_states else {"lr_scheduler"}
        _restore_statefuls(engine, shared, step_dir=step_dir, skip=skip)
    reader.load_tensors(wanted)
    engine.sharding.load_state_dict(state)
    if not load_module_only:
        engine.global_steps = int(shared["global_steps"])
        # Resume on an accumulation boundary of *this* run: the accumulation count follows the world size
        # (fixed global batch), and gradients of a half-finished window are not part of a checkpoint.
        engine.micro_steps = engine.global_steps * int(engine.gradient_accumulation_steps())
        if hasattr(engine, "global_samples"):
            engine.global_samples = int(shared.get("global_samples", 0))
        _restore_rank_rng(reader, rank=_rank())
        _restore_comm_state(engine, reader)
    saved = reader.manifest.degrees or {}
    log.info(
        "loaded checkpoint %s (saved at world size %d, data-parallel size %s)",
        step_dir, reader.manifest.world_size,
        saved.get("dp_replicate", 1) * saved["dp_shard"] if "dp_shard" in saved else "unrecorded",
    )
    return str(step_dir), shared.get("client_state", {})


def _flat_keys(state: dict, prefix: str = "") -> list[str]:
    keys: list[str] = []
    for key, value in state.items():
        keys += _flat_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


def _only_saved(template: dict, saved: dict, prefix: str = "") -> dict:
    """`template` without the tensor leaves the checkpoint does not hold (DCP's flat key names)."""
    out: dict = {}
    for key, value in template.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out[key] = _only_saved(value, saved, prefix=f"{name}.")
        elif not isinstance(value, torch.Tensor) or name in saved:
            out[key] = value
    return out


def _restore_statefuls(engine: Any, shared: dict, *, step_dir: Path, skip: set[str]) -> None:
    for name in _OPTIONAL_STATEFUL:
        obj = getattr(engine, name, None)
        if name in skip or obj is None or not hasattr(obj, "load_state_dict"):
            continue
        if name not in shared:
            raise CheckpointError(f"{step_dir / ENGINE_STATE}: has no saved {name} state, but the engine has one")
        try:
            obj.load_state_dict(shared[name])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{step_dir / ENGINE_STATE}: {name}: {e}") from e


def _complete_optimizer_template(state: dict, saved: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Give a never-stepped, unsharded optimizer state templates to load into.

    DCP loads in place, so it needs a tensor for every saved optimizer entry. Strategies built on
    `get_state_dict` initialize the state themselves; one that holds plain (replicated) tensors and
    returns an empty state before the first step gets plain zero tensors of the saved shape here,
    which is that layout exactly. A sharded (DTensor) model with empty optimizer state is left alone:
    its layout is the strategy's, and check_shapes reports the gap.
    """
    optim = state.get("optim")
    if not isinstance(optim, dict) or optim.get("state"):
        return
    if any(isinstance(t, DTensor) for t in state["model"].values()):
        return
    fqns = {fqn for group in optim.get("param_groups", []) for fqn in group.get("params", [])}
    filled: dict[str, dict[str, torch.Tensor]] = {}
    for key, (shape, dtype) in saved.items():
        if not key.startswith("optim.state."):
            continue
        fqn, _, name = key[len("optim.state.") :].rpartition(".")
        if fqn in fqns:
            filled.setdefault(fqn, {})[name] = torch.zeros(shape, dtype=dtype)
    optim["state"] = filled


def _comm_owners(engine: Any) -> dict[str, Any]:
    """What holds rank-local communication state (error feedback): the 1-bit optimizers."""
    owners = {"optimizer": getattr(engine, "optimizer", None)}
    return {name: obj for name, obj in owners.items() if hasattr(obj, "comm_state_dict")}


def _comm_state(engine: Any) -> dict:
    """This rank's error-feedback buffers, saved in its own rank file (they differ per rank and their
    layout depends on the world size, so they are not part of the resharded tensors)."""
    owners = _comm_owners(engine)
    return {"comm_state": {name: obj.comm_state_dict() for name, obj in owners.items()}} if owners else {}


def _restore_comm_state(engine: Any, reader: StepReader) -> None:
    """Restore this rank's error feedback when the world size is the saving one; otherwise each owner
    resets its errors and logs that it did."""
    mine = reader.rank_state(_rank())
    same_world = reader.manifest.world_size == comm.get_world_size()
    saved = (mine or {}).get("comm_state", {}) if same_world else {}
    for name, obj in _comm_owners(engine).items():
        obj.load_comm_state_dict(saved.get(name))


def _restore_rank_rng(reader: StepReader, *, rank: int) -> None:
    mine = reader.rank_state(rank)
    if mine is not None:
        restore_rng(mine["rng"])
        return
    # A rank the saving world did not have: a deterministic stream of its own (see state.py).
    source = reader.rank_state(0)
    if source is None:
        raise CheckpointError(f"{reader.step_dir}: rank 0's state file is missing from the manifest")
    seed_all(derived_rng_seed(source["rng"], rank=rank))


def _rank() -> int:
    return comm.get_rank()


def _zero_stage(engine: Any) -> int | None:
    zero = getattr(getattr(engine, "config", None), "zero_optimization", None)
    stage = getattr(zero, "stage", None)
    return int(stage) if stage is not None else None


def config_hash(config: Any) -> str | None:
    """sha256 of the engine config's JSON (recorded in the manifest for inspection), None without one."""
    if config is None:
        return None
    if hasattr(config, "model_dump"):
        data = config.model_dump(mode="json")
    elif isinstance(config, dict):
        data = config
    else:
        return None
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def _version(dist_name: str) -> str:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "unknown"
