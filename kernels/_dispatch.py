"""Choose between the pure-torch reference and the Triton implementation of each kernel.

Called by every op module in `deepfleet.kernels` from inside its `torch.library` custom op, so the
choice happens at run time, per call, on the actual tensors.

The choice is explicit:
  - `DEEPFLEET_KERNELS=auto` (default): Triton only when triton imports and every tensor is on CUDA;
  - `DEEPFLEET_KERNELS=torch`: always the reference;
  - `DEEPFLEET_KERNELS=triton`: always Triton, an error if it cannot run. CPU tensors are accepted only
    under `TRITON_INTERPRET=1` (the interpreter the CPU tests use).
`force_impl("torch"|"triton"|"auto")` overrides the variable inside a `with` block (a context variable,
so threads and tasks do not leak choices into each other).

Triton modules under `kernels/_triton/` are imported here, lazily, on the first Triton call: the
interpreter reads `TRITON_INTERPRET` when kernels are decorated, and an install without triton must
import every op module.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
from collections.abc import Iterator
from types import ModuleType

import torch

IMPLS = ("auto", "torch", "triton")
ENV_VAR = "DEEPFLEET_KERNELS"

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("deepfleet_kernels_forced", default=None)


def _check(name: str, *, field: str) -> str:
    if name not in IMPLS:
        raise ValueError(f"{field}={name!r} is not a kernel implementation; use one of {', '.join(IMPLS)}")
    return name


def selected_impl() -> str:
    """The implementation asked for: the innermost `force_impl`, else `DEEPFLEET_KERNELS`, else auto."""
    forced = _forced.get()
    if forced is not None:
        return forced
    return _check(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", field=ENV_VAR)


@contextlib.contextmanager
def force_impl(name: str) -> Iterator[None]:
    """Run the enclosed kernel calls with implementation `name` ("auto", "torch" or "triton")."""
    token = _forced.set(_check(name, field="force_impl"))
    try:
        yield
    finally:
        _forced.reset(token)


@functools.cache
def triton_available() -> bool:
    """True when triton imports (cached: the answer cannot change within a process). Probed through
    `_triton.launch`, which holds no kernels, so triton stays imported only under `_triton/`."""
    try:
        triton_module("launch")
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(*tensors: torch.Tensor) -> bool:
    """Whether this call should take the Triton path for `tensors` (raises if "triton" cannot run)."""
    impl = selected_impl()
    if impl == "torch":
        return False
    on_cuda = all(t.device.type == "cuda" for t in tensors)
    if impl == "auto":
        return on_cuda and triton_available()
    if not triton_available():
        raise RuntimeError(
            f"{ENV_VAR}=triton but triton does not import; install deepfleet[kernels] or set {ENV_VAR}=auto"
        )
    if not on_cuda and not interpreting():
        raise RuntimeError(
            f"{ENV_VAR}=triton needs CUDA tensors (or TRITON_INTERPRET=1 to interpret on CPU); "
            f"got {sorted({t.device.type for t in tensors})}"
        )
    return True


def triton_module(op: str) -> ModuleType:
    """Import and return `deepfleet.kernels._triton.<op>` (first use only pays the import)."""
    return importlib.import_module(f"{__package__}._triton.{op}")
