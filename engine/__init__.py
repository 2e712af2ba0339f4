"""deepfleet's training engine, DeepSpeed-shaped: porting a script is an import change
(`import deepfleet.engine as deepspeed`).

The public names load lazily (PEP 562), so importing this package runs nothing and pulls in no torch.
"""

_EXPORTS = {
    "initialize": "deepfleet.engine.engine",
    "DeepFleetEngine": "deepfleet.engine.engine",
    "init_distributed": "deepfleet.engine.dist",
    "init_inference": "deepfleet.engine.inference.engine",
    "InferenceEngine": "deepfleet.engine.inference.engine",
    "DeepSpeedEngine": "deepfleet.engine.engine",
    "add_config_arguments": "deepfleet.engine.compat.args",
    "DeepSpeedConfig": "deepfleet.engine.compat.config",
    "tp_model_init": "deepfleet.engine.autotp",
    "__version__": "deepfleet.engine.compat.version",
    "__deepspeed_compat_version__": "deepfleet.engine.compat.version",
}
# Submodules a DeepSpeed script reaches as attributes (`deepspeed.comm.get_rank()`, `deepspeed.zero.Init`).
_SUBMODULES = ("comm", "accelerator", "ops", "utils", "zero", "runtime", "checkpointing", "moe", "pipe")
# Modules of a submodule package that scripts reach as attributes (`deepspeed.moe.layer.MoE`).
_SUBMODULE_PARTS = {"moe": ("layer", "utils")}


def __getattr__(name):
    import importlib

    if name in _SUBMODULES:
        for part in _SUBMODULE_PARTS.get(name, ()):
            importlib.import_module(f"deepfleet.engine.{name}.{part}")
        return importlib.import_module(f"deepfleet.engine.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepfleet.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
