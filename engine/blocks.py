"""`blocks(model)`: the model's repeated transformer blocks, in forward order — the one answer to "what
are the layers" for every feature that works block by block.

Caller: `zero/fsdp.py` (each block becomes its own FSDP2 unit). Activation checkpointing and pipeline
stages, when they land, are to wrap and split on the same list, so the three always agree.

How the blocks are found, first rule that gives any:
1. An explicit override on the model or any submodule: `deepfleet_blocks`, either a dotted attribute
   path to a container (`"model.layers"`) or a list/tuple of class names (`["DecoderLayer"]`).
2. Hugging Face's `_no_split_modules` (class names a model must not be split inside; every
   `PreTrainedModel` declares its decoder layer there): the outermost submodules of those classes.
3. The container paths of the common architectures: `transformer.h` (GPT-2, GPT-J, BLOOM, Falcon),
   `model.layers` (Llama, Mistral, Qwen, Gemma), `model.decoder.layers` (OPT, BART decoder),
   `gpt_neox.layers`, `transformer.blocks` (MPT), `layers`, `blocks`, `h`.
4. Otherwise the children of every `nn.ModuleList` whose children all share one class (the example
   GPT's `blocks`, and wrappers around any of the above), outermost lists only, so a list nested in a
   block (an MoE layer's experts) never splits that block.
Nothing found: `[]` (the model is one unit).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

OVERRIDE_ATTR = "deepfleet_blocks"
Z3_LEAF_ATTR = "_z3_leaf"
"""Set on a module that ZeRO-3 must gather whole (`deepspeed.utils.set_z3_leaf_modules`)."""
KNOWN_PATHS = (
    "transformer.h",
    "model.layers",
    "model.decoder.layers",
    "gpt_neox.layers",
    "transformer.blocks",
    "layers",
    "blocks",
    "h",
)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of `model` in module-registration order (see the module docstring for the rules).

    Raises ValueError when a `deepfleet_blocks` override names no container or no module."""
    for owner_name, owner in model.named_modules():
        override = getattr(owner, OVERRIDE_ATTR, None)
        if override is not None:
            where = f"{owner_name}.{OVERRIDE_ATTR}" if owner_name else OVERRIDE_ATTR
            return _from_override(owner, override, where=where)
    for _, owner in model.named_modules():
        names = getattr(owner, "_no_split_modules", None)
        if names:
            found = _outermost_of_classes(owner, set(names))
            if found:
                return found
    for path in KNOWN_PATHS:
        container = _get_path(model, path)
        if isinstance(container, (nn.ModuleList, nn.Sequential)) and len(container):
            return list(container)
    return _homogeneous_lists(model)


def _from_override(owner: nn.Module, override: object, *, where: str) -> list[nn.Module]:
    if isinstance(override, str):
        container = _get_path(owner, override)
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            raise ValueError(f"{where}: {override!r} is not an nn.ModuleList or nn.Sequential of the model; "
                             "name the attribute path of the container of blocks (e.g. \"model.layers\")")
        return list(container)
    if isinstance(override, Sequence) and all(isinstance(n, str) for n in override):
        found = _outermost_of_classes(owner, set(override))
        if not found:
            raise ValueError(f"{where}: no submodule has a class named {sorted(override)}; list the class "
                             "names of the blocks (e.g. [\"DecoderLayer\"])")
        return found
    raise ValueError(f"{where}: expected an attribute path or a list of class names, got {type(override).__name__}")


def _get_path(module: nn.Module, path: str) -> object:
    obj: object = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _outermost_of_classes(model: nn.Module, names: set[str]) -> list[nn.Module]:
    found: list[nn.Module] = []
    inside: set[int] = set()  # ids of every module under one already taken
    for m in model.modules():
        if id(m) in inside:
            continue
        if type(m).__name__ in names and m is not model:
            found.append(m)
            inside.update(id(sub) for sub in m.modules())
    return found


def _homogeneous_lists(model: nn.Module) -> list[nn.Module]:
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or not isinstance(m, nn.ModuleList) or not len(m):
            continue
        if len({type(child) for child in m}) == 1:
            found.extend(m)
            inside.update(id(sub) for sub in m.modules())
    return found


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules ZeRO-3 shards as units: `blocks(model)`, except that a module marked as a ZeRO-3
    leaf (`Z3_LEAF_ATTR`) that contains blocks replaces them (outermost leaf first), so it is
    gathered whole."""
    leaves = [m for m in model.modules() if m is not model and getattr(m, Z3_LEAF_ATTR, False)]
    found = blocks(model)
    if not leaves:
        return found
    inside: dict[int, nn.Module] = {}
    for leaf in leaves:  # model.modules() is outermost first, so the first leaf holding a block wins
        for sub in leaf.modules():
            inside.setdefault(id(sub), leaf)
    units: list[nn.Module] = []
    for block in found:
        unit = inside.get(id(block), block)
        if all(unit is not u for u in units):
            units.append(unit)
    return units

