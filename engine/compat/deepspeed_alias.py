"""`import deepspeed` resolving to deepfleet's adapters, inside processes that `deepfleet run` starts.

Installed only by `deepfleet.engine.compat.script_entry` (the per-rank entry `deepfleet run` launches):
a meta-path finder placed first on `sys.meta_path` maps `deepspeed` to `deepfleet.engine` and
`deepspeed.<path>` to `deepfleet.engine.<path>` (the same module objects, registered under both names),
and answers `importlib.metadata` for a `deepspeed` distribution whose version is the DeepSpeed release this
engine follows, because integrations (Hugging Face Transformers/Accelerate) check for an installed
distribution before they import it. Nothing is installed or patched on disk, so a real DeepSpeed elsewhere
(any other process, any other virtual environment) is never shadowed. A DeepSpeed module path this engine
does not provide fails with ModuleNotFoundError naming it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from typing import Any

ALIAS = "deepspeed"
TARGET = "deepfleet.engine"
# Adapter packages whose submodules are imported with them (the rest of the engine loads on first use).
EAGER_PACKAGES = frozenset({f"{TARGET}.runtime", f"{TARGET}.runtime.zero", f"{TARGET}.ops", f"{TARGET}.utils",
                            f"{TARGET}.moe"})


def _import_tree(package: str) -> None:
    import pkgutil

    module = importlib.import_module(package)
    for info in pkgutil.iter_modules(module.__path__):
        importlib.import_module(f"{package}.{info.name}")


class _AliasLoader(importlib.abc.Loader):
    """Returns the already importable deepfleet module for a `deepspeed.*` name."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        module = importlib.import_module(self.target)
        # DeepSpeed's packages import their submodules, and callers rely on it
        # (`deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES` after a bare `import deepspeed`)
        for package in sorted(EAGER_PACKAGES) if self.target == TARGET else [self.target] * (self.target in EAGER_PACKAGES):
            _import_tree(package)
        return module

    def exec_module(self, module: Any) -> None:
        """The target module is executed by its own import."""


class _DeepSpeedDistribution(importlib.metadata.Distribution):
    """The metadata of the `deepspeed` distribution a script sees under `deepfleet run`."""

    def __init__(self, version: str) -> None:
        self._version = version

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {self._version}\n"
                    "Summary: deepfleet's DeepSpeed-compatible engine (deepfleet run)\n")
        if filename == "top_level.txt":
            return f"{ALIAS}\n"
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(importlib.import_module(TARGET).__file__).parent / str(path)


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """See the module docstring."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real = TARGET + fullname[len(ALIAS):]
        try:
            real_spec = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            real_spec = None
        if real_spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: deepfleet's DeepSpeed adapters do not provide it "
                f"(see the README's list of what runs unchanged)", name=fullname,
            )
        return importlib.util.spec_from_loader(
            fullname, _AliasLoader(real), is_package=real_spec.submodule_search_locations is not None
        )

    def find_distributions(self, context: Any = None) -> list[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and name.lower().replace("_", "-") != ALIAS:
            return []
        from deepfleet.engine.compat.version import __deepspeed_compat_version__

        return [_DeepSpeedDistribution(__deepspeed_compat_version__)]


def install() -> None:
    """Put the finder first on `sys.meta_path` (idempotent)."""
    if not any(isinstance(f, DeepSpeedAliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedAliasFinder())
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        del sys.modules[name]  # a real DeepSpeed imported earlier in this process is not mixed in
