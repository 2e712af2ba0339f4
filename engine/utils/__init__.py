"""`deepspeed.utils`' path under deepfleet (logger, log_dist, RepeatingLoader, groups, ZeRO-3 leaf
modules, zero_to_fp32); the code lives in `deepfleet.engine.compat`. Names load lazily (PEP 562)."""

_EXPORTS = {
    "logger": "deepfleet.engine.compat.logging",
    "log_dist": "deepfleet.engine.compat.logging",
    "print_json_dist": "deepfleet.engine.compat.logging",
    "RepeatingLoader": "deepfleet.engine.compat.loader",
    "set_z3_leaf_modules": "deepfleet.engine.compat.leaf_modules",
    "unset_z3_leaf_modules": "deepfleet.engine.compat.leaf_modules",
    "get_z3_leaf_modules": "deepfleet.engine.compat.leaf_modules",
    "z3_leaf_module": "deepfleet.engine.compat.leaf_modules",
}
_SUBMODULES = ("groups", "zero_to_fp32")


def __getattr__(name):
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"deepfleet.engine.utils.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepfleet.engine.utils' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
