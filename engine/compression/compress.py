"""DeepSpeed Compression's entry points: `init_compression`, `redundancy_clean`, `student_initialization`.

Called by user scripts (`from deepfleet.engine.compression.compress import init_compression`, the
import path DeepSpeed users had) and by `engine/build.py`, which compresses a model itself when the
engine config has an enabled `compression_training` section and the script did not. A config is a
dict, a JSON/YAML path, a whole engine config, or a parsed `CompressionConfig`.

Module selection is DeepSpeed's: for each technique, each group's `modules` patterns are searched
(re.search) in the names of the model's Linear/Conv2d/Embedding layers; a layer named twice within
one technique is an error. `init_compression` swaps those layers for the compression-aware ones in
`layers.py` and attaches each technique's merged group + shared settings; `redundancy_clean`
(`export.py`) turns the trained result into a smaller plain model.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from torch import nn

from deepfleet.engine.compression.layers import WRAPPERS, CompressedMixin
from deepfleet.engine.config_compression import CompressionConfig

MARKER = "_deepfleet_compression"  # attribute set on a model init_compression has prepared


def compression_config(source: Any) -> CompressionConfig:
    """The `compression_training` section of `source` (dict, path, engine config or the section)."""
    if isinstance(source, CompressionConfig):
        return source
    section = getattr(source, "compression_training", None)
    if section is not None or hasattr(source, "zero_optimization"):
        return section if section is not None else CompressionConfig()
    from deepfleet.engine.config_base import ConfigError
    from deepfleet.engine.config_source import read_source

    errors: list[str] = []
    data = read_source(str(source) if isinstance(source, Path) else source, errors)
    if data is None:
        raise ConfigError(errors)
    from pydantic import ValidationError

    try:
        return CompressionConfig.model_validate(data.get("compression_training", {}))
    except ValidationError as e:
        lines = [f"compression_training.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()]
        raise ConfigError(lines) from None


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


def matching(model: nn.Module, pattern: str, *, related: bool = False) -> list[str]:
    """Names of compressible layers of `model` whose name contains a match of `pattern` ("*": all);
    `related` also admits BatchNorm2d, whose channels follow a pruned conv."""
    kinds = (*WRAPPERS, nn.BatchNorm2d) if related else tuple(WRAPPERS)
    return [name for name, m in model.named_modules()
            if name and isinstance(m, kinds) and (pattern == "*" or re.search(pattern, name))]


def technique_targets(model: nn.Module, cfg: CompressionConfig) -> list[dict[str, Any]]:
    """Per enabled technique and group: {technique, group, settings, modules: [[names] per pattern],
    related: [[[names] per related pattern] per pattern] or None}."""
    out = []
    for technique, section in cfg.techniques().items():
        seen: set[str] = set()
        # Shared settings win over a group's on a clash (DeepSpeed's merge); unset ones do not clash.
        shared = {k: v for k, v in section.shared_parameters.model_dump().items() if v is not None}
        if technique == "sparse_pruning":
            shared["nm"] = section.shared_parameters.nm()
        for group_name, group in section.different_groups.items():
            per_pattern = []
            for pattern in group.modules:
                names = matching(model, pattern)
                for name in names:
                    if name in seen:
                        raise ValueError(
                            f"compression_training.{technique}.different_groups.{group_name}.modules: {name} is "
                            "already compressed by another pattern or group; make the patterns disjoint"
                        )
                    seen.add(name)
                per_pattern.append(names)
            related = None
            if group.related_modules is not None:
                related = [[matching(model, p, related=True) for p in rel] for rel in group.related_modules]
            out.append({"technique": technique, "group": group_name, "settings": {**group.params.model_dump(), **shared},
                        "modules": per_pattern, "related": related})
    return out


def init_compression(model: nn.Module, deepspeed_config: Any, teacher_model: nn.Module | None = None,
                     mpu: Any = None) -> nn.Module:
    """Prepare `model` for compression training in place and return it (DeepSpeed's signature).

    With layer reduction enabled, the student `model` is first initialized from `teacher_model`'s
    chosen layers. Calling it twice is harmless (layers already prepared are not wrapped again).
    Raises ValueError/ConfigError naming the key at fault."""
    if mpu is not None:
        raise ValueError("mpu: model-parallel units are not supported by compression; drop the mpu argument")
    cfg = compression_config(deepspeed_config)
    target = _unwrap(model)
    if getattr(target, MARKER, None) is not None:
        return model
    if cfg.layer_reduction.enabled:
        if teacher_model is None:
            raise ValueError("teacher_model: layer_reduction is enabled; pass teacher_model= to init_compression")
        student_initialization(target, _unwrap(teacher_model), cfg)
    for item in technique_targets(target, cfg):
        for names in item["modules"]:
            for name in names:
                layer = _wrapped(target, name)
                try:
                    layer.enable(item["technique"], dict(item["settings"]))
                except ValueError as e:
                    raise ValueError(f"compression_training.{item['technique']} ({name}): {e}") from None
    object.__setattr__(target, MARKER, cfg)  # not a submodule or parameter: invisible to state dicts
    return model


def _wrapped(model: nn.Module, name: str) -> CompressedMixin:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    layer = getattr(parent, child)
    if isinstance(layer, CompressedMixin):
        return layer
    new = WRAPPERS[type(layer)].wrap(layer) if type(layer) in WRAPPERS else None
    if new is None:  # a subclass of a torch layer: wrap by its nearest supported base
        base = next(b for b in WRAPPERS if isinstance(layer, b))
        new = WRAPPERS[base].wrap(layer)
    new.train(layer.training)
    setattr(parent, child, new)
    return new


def is_compressed(model: nn.Module) -> bool:
    """Whether `init_compression` has prepared `model`."""
    return getattr(_unwrap(model), MARKER, None) is not None


def student_initialization(student_model: nn.Module, teacher_model: nn.Module, deepspeed_config: Any) -> None:
    """Copy teacher layer `teacher_layer[i]` into student layer i under `module_name_prefix`, and every
    module of `other_module_name` as a whole (DeepSpeed's layer-reduction initialization)."""
    lr = compression_config(deepspeed_config).layer_reduction
    prefix = lr.module_name_prefix
    pairs = [(f"{prefix}.{i}", f"{prefix}.{t}") for i, t in enumerate(lr.teacher_layer)]
    pairs += [(name, name) for name in lr.other_module_name]
    for s_name, t_name in pairs:
        try:
            s_mod, t_mod = student_model.get_submodule(s_name), teacher_model.get_submodule(t_name)
        except AttributeError as e:
            raise ValueError(f"compression_training.layer_reduction: no module {e}; check module_name_prefix, "
                             "teacher_layer and other_module_name against the models") from None
        s_state, t_state = s_mod.state_dict(), t_mod.state_dict()
        if {k: v.shape for k, v in s_state.items()} != {k: v.shape for k, v in t_state.items()}:
            raise ValueError(f"compression_training.layer_reduction: student {s_name} and teacher {t_name} "
                             "differ in shape; the student must be the teacher with fewer layers")
        s_mod.load_state_dict(t_state)


def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu: Any = None) -> nn.Module:
    """Fold the trained compression into a smaller plain model and return it (in place, as DeepSpeed):
    pruned rows/heads/channels are removed (and the matching inputs of related modules), sparse
    masks are applied, quantized layers store int8/int4 codes with scales. See `export.py`."""
    if mpu is not None:
        raise ValueError("mpu: model-parallel units are not supported by compression; drop the mpu argument")
    from deepfleet.engine.compression.export import clean

    return clean(model, compression_config(deepspeed_config))
