"""The ZeRO strategies (one module per stage), and `deepspeed.zero`'s names at its path:
`Init`, `GatheredParameters` (code: `deepfleet.engine.compat.zero`). Names load lazily (PEP 562)."""

_EXPORTS = {
    "Init": "deepfleet.engine.compat.zero",
    "GatheredParameters": "deepfleet.engine.compat.zero",
    "ZeroParamStatus": "deepfleet.engine.compat.zero",
}


def __getattr__(name):
    import importlib

    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepfleet.engine.zero' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
