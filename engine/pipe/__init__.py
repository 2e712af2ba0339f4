"""Pipeline parallelism, and `deepspeed.pipe`'s names at its path: `PipelineModule`, `LayerSpec`,
`TiedLayerSpec` (code: `deepfleet.engine.pipe.module`). Names load lazily (PEP 562)."""

_EXPORTS = {
    "PipelineModule": "deepfleet.engine.pipe.module",
    "LayerSpec": "deepfleet.engine.pipe.module",
    "TiedLayerSpec": "deepfleet.engine.pipe.module",
}


def __getattr__(name):
    import importlib

    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepfleet.engine.pipe' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
