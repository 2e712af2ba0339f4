"""`deepspeed.utils.set_z3_leaf_modules` and friends: modules ZeRO-3 must gather as one unit.

DeepSpeed hooks every submodule at stage 3 and fetches parameters module by module; a "leaf" module
(an MoE block whose experts run data-dependently) is fetched whole instead, so ranks never wait on
each other's different expert choices. Stage 3 here shards per block (`engine/blocks.py` units), so a
leaf already inside a block is gathered with it; a leaf that *contains* blocks becomes the unit instead
of them (`deepfleet.engine.blocks.shard_units`). The mark is an attribute on the module."""

from __future__ import annotations

from torch import nn

from deepfleet.engine.blocks import Z3_LEAF_ATTR


def _classes(leaf_module_classes: list) -> tuple[type, ...]:
    out = []
    for c in leaf_module_classes:
        if not isinstance(c, type):
            raise ValueError(f"leaf_module_classes: {c!r} is not a class; pass module classes (or use names)")
        out.append(c)
    return tuple(out)


def _matches(module: nn.Module, classes: tuple[type, ...], names: set[str]) -> bool:
    return isinstance(module, classes) or type(module).__name__ in names


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes: list) -> list[nn.Module]:
    """Mark every submodule of `model` that is an instance of one of `leaf_module_classes` (classes or
    class names); returns the marked modules. Raises ValueError when none matches."""
    names = {c for c in leaf_module_classes if isinstance(c, str)}
    classes = _classes([c for c in leaf_module_classes if not isinstance(c, str)])
    marked = [m for m in model.modules() if _matches(m, classes, names)]
    if not marked:
        raise ValueError(f"leaf_module_classes: no submodule of the model is one of {leaf_module_classes}")
    for m in marked:
        setattr(m, Z3_LEAF_ATTR, True)
    return marked


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes: list) -> list[nn.Module]:
    names = {c for c in leaf_module_classes if isinstance(c, str)}
    classes = _classes([c for c in leaf_module_classes if not isinstance(c, str)])
    cleared = [m for m in model.modules() if _matches(m, classes, names)]
    for m in cleared:
        if hasattr(m, Z3_LEAF_ATTR):
            delattr(m, Z3_LEAF_ATTR)
    return cleared


def z3_leaf_module(model: nn.Module) -> bool:
    return bool(getattr(model, Z3_LEAF_ATTR, False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]
