"""DeepSpeed's FLOPs profiler API on `torch.utils.flop_counter`: `FlopsProfiler` and `get_model_profile`.

Callers: user scripts (`from deepfleet.engine.profiling.flops_profiler import get_model_profile`, the
path DeepSpeed users import) and the engine, which profiles one training step at
`flops_profiler.profile_step` (`step_flops.py`). Counting is torch's FlopCounterMode plus honest
attention formulas (`attention_flops.py`): causal and masked attention count only the pairs computed.
Why not DeepSpeed's approach of patching `torch.nn.functional`: FlopCounterMode sees every aten op
(including those reached without `F.*`, e.g. `x @ w` and fused kernels) with no monkey-patching.

Per module: parameters, MACs (FLOPs / 2: every counted op is multiply-add shaped), FLOPs and forward
latency (forward hooks with `perf_counter`; on an accelerator the profiler synchronizes around each
module, which is why it runs only on the profiled step, never on every step). Report layout follows
DeepSpeed's: a summary, the top `top_modules` modules per depth by MACs, params and latency, then
(with `detailed`) the module tree down to `module_depth` (-1: all depths).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any, TextIO

import torch
from torch import nn

from deepfleet.engine.profiling.counter import FlopCount

__all__ = ["FlopsProfiler", "get_model_profile", "number_to_string", "macs_to_string", "params_to_string"]


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """12.3e9 -> "12.3 G" (DeepSpeed's formatting helper)."""
    if units is None:
        units = next((u for u, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)) if abs(num) >= scale), "")
    scale = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0}[units]
    return f"{num / scale:.{precision}f} {units}".rstrip()


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    return _with_unit(number_to_string(macs, units, precision), "MACs")


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    return _with_unit(number_to_string(flops, units, precision), "FLOPS")


def _with_unit(number: str, unit: str) -> str:
    """"1.20 G" + "MACs" -> "1.20 GMACs"; "0.00" + "MACs" -> "0.00 MACs"."""
    return number + unit if number[-1].isalpha() else f"{number} {unit}"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(params, units, precision)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class FlopsProfiler:
    """Profiles the forward (and, in the engine, backward) passes run between `start_profile()` and
    `stop_profile()`: FLOPs, MACs and parameters in total and per module, and each module's forward
    latency. `ignore_list` holds module types whose FLOPs are left out of every total."""

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self.counts = FlopCount(model)
        self._latency: dict[str, float] = {}
        self._hooks: list[Any] = []
        self._ignored: set[str] = set()
        self._region: Any = None

    # -- DeepSpeed's profiler protocol ---------------------------------------------------------------

    def start_profile(self, ignore_list: Iterable[type] | None = None) -> None:
        self.reset_profile()
        ignore = tuple(ignore_list or ())
        self._ignored = {n for n, m in self.model.named_modules() if ignore and isinstance(m, ignore)}
        self.attach_hooks()
        self._region = self.counts.count()
        self._region.__enter__()
        self.started = True

    def stop_profile(self) -> None:
        if self._region is not None:
            self._region.__exit__(None, None, None)
            self._region = None
        self.detach_hooks()

    def attach_hooks(self) -> None:
        """Time every module's forward (what the report's latency column shows)."""
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        for name, module in self.model.named_modules():
            self._hooks.append(module.register_forward_pre_hook(self._pre_hook(name, device)))
            self._hooks.append(module.register_forward_hook(self._post_hook(name, device)))

    def detach_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def end_profile(self) -> None:
        self.stop_profile()
        self.started = False

    def reset_profile(self) -> None:
        self.counts = FlopCount(self.model)
        self._latency = {}

    def _pre_hook(self, name: str, device: torch.device):
        def hook(module: nn.Module, args: Any) -> None:
            _sync(device)
            self._latency[name + "\0start"] = time.perf_counter()
        return hook

    def _post_hook(self, name: str, device: torch.device):
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            _sync(device)
            start = self._latency.pop(name + "\0start", None)
            if start is not None:
                self._latency[name] = self._latency.get(name, 0.0) + time.perf_counter() - start
        return hook

    # -- totals ------------------------------------------------------------------------------------

    def module_flops(self, name: str) -> int:
        """Forward FLOPs of the module; a container never called itself (ModuleList) sums its children."""
        if name in self.counts.per_module or name in self._latency:
            return self.counts.per_module.get(name, 0)
        return sum(self.module_flops(child) for child in self._children(name))

    def module_params(self, name: str) -> int:
        module = self.model.get_submodule(name) if name else self.model
        return sum(p.numel() for p in module.parameters())

    def module_latency(self, name: str) -> float:
        if name in self._latency:
            return self._latency[name]
        return sum(self.module_latency(child) for child in self._children(name))

    def _children(self, name: str) -> list[str]:
        module = self.model.get_submodule(name) if name else self.model
        return [f"{name}.{child}" if name else child for child, _ in module.named_children()]

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs (DeepSpeed's meaning), ignored modules left out."""
        ignored = sum(self.module_flops(n) for n in _outermost(self._ignored))
        total = self.counts.by_phase.get("forward", 0) - ignored
        return number_to_string(total) if as_string else total

    def get_total_macs(self, as_string: bool = False) -> int | str:
        macs = int(self.get_total_flops()) // 2
        return macs_to_string(macs) if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        params = sum(p.numel() for p in self.model.parameters())
        return params_to_string(params) if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        seconds = self.module_latency("")
        return f"{seconds * 1000:.2f} ms" if as_string else seconds

    # -- the report ----------------------------------------------------------------------------------

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> None:
        """Write the report to `output_file` (appended) or stdout."""
        if output_file:
            with open(output_file, "a") as out:
                self._write(out, profile_step, module_depth=module_depth, top_modules=top_modules, detailed=detailed)
        else:
            self._write(sys.stdout, profile_step, module_depth=module_depth, top_modules=top_modules,
                        detailed=detailed)

    def _write(self, out: TextIO, profile_step: int, *, module_depth: int, top_modules: int, detailed: bool) -> None:
        flops, latency = int(self.get_total_flops()), self.get_total_duration()
        w = out.write
        w("-------------------------- DeepFleet Flops Profiler --------------------------\n")
        w(f"Profile Summary at step {profile_step}:\n")
        w(f"params:                     {params_to_string(int(self.get_total_params()))}\n")
        w(f"fwd MACs:                   {macs_to_string(flops // 2)}\n")
        w(f"fwd flops:                  {number_to_string(flops)}\n")
        backward = self.counts.by_phase.get("backward", 0)
        if backward:
            w(f"bwd flops:                  {number_to_string(backward)}\n")
        w(f"fwd latency:                {latency * 1000:.2f} ms\n")
        if latency > 0:
            w(f"FLOPS (flops / latency):    {flops_to_string(flops / latency)}\n")
        names = [n for n, _ in self.model.named_modules()]
        by_depth: dict[int, list[str]] = {}
        for n in names:
            by_depth.setdefault(_depth(n), []).append(n)
        w("\n----------------------------- Aggregated Profile -----------------------------\n")
        w(f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:\n")
        for depth in sorted(by_depth):
            if module_depth != -1 and depth > module_depth:
                break
            def top(key, group=by_depth[depth]):
                return sorted(group, key=key, reverse=True)[:top_modules]
            w(f"depth {depth}:\n")
            w("    params      - " + _listing(top(self.module_params), lambda n: params_to_string(self.module_params(n))))
            w("    MACs        - " + _listing(top(self.module_flops),
                                             lambda n: macs_to_string(self.module_flops(n) // 2)))
            w("    fwd latency - " + _listing(top(self.module_latency),
                                             lambda n: f"{self.module_latency(n) * 1000:.2f} ms"))
        if detailed:
            w("\n------------------------------ Detailed Profile ------------------------------\n")
            w("Each module: params, percentage of total params, MACs, percentage of total MACs, fwd latency\n")
            total_params = max(1, int(self.get_total_params()))
            total_flops = max(1, flops)
            for n in names:
                if module_depth != -1 and _depth(n) > module_depth:
                    continue
                module = self.model.get_submodule(n) if n else self.model
                f = self.module_flops(n)
                w("  " * _depth(n) + f"{n or '(model)'} {type(module).__name__}: "
                  f"{params_to_string(self.module_params(n))}, {100 * self.module_params(n) / total_params:.2f}% "
                  f"Params, {macs_to_string(f // 2)}, {100 * f / total_flops:.2f}% MACs, "
                  f"{self.module_latency(n) * 1000:.2f} ms\n")
        w("------------------------------------------------------------------------------\n")


def _depth(name: str) -> int:
    return 0 if not name else name.count(".") + 1


def _outermost(names: set[str]) -> list[str]:
    """Names none of whose ancestors is in the set (so nested ignored modules are not subtracted twice)."""
    return [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]


def _listing(names: list[str], fmt) -> str:
    return "{" + ", ".join(f"'{n or '(model)'}': '{fmt(n)}'" for n in names) + "}\n"


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: list | tuple = [],  # noqa: B006 — DeepSpeed's signature; never mutated here
    kwargs: dict = {},  # noqa: B006
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: list[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """FLOPs, MACs and parameters of one forward (`mode="forward"`) or `model.generate` (`"generate"`)
    call, after `warm_up` untimed calls: `(flops, macs, params)`, as strings like "1.23 G" when
    `as_string`. `input_shape` (batch included) builds one float input of that shape in the model's
    dtype; otherwise `args`/`kwargs` are passed."""
    if mode not in ("forward", "generate"):
        raise ValueError(f"mode: {mode!r} is not a mode; use 'forward' or 'generate'")
    param = next(model.parameters(), None)
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"input_shape: {input_shape!r} is not a non-empty tuple; write e.g. (1, 3, 224, 224)")
        dtype = param.dtype if param is not None else torch.float32
        device = param.device if param is not None else None
        args = [torch.ones(input_shape, dtype=dtype, device=device)]
    if not args and not kwargs:
        raise ValueError("args: give input_shape, or args and/or kwargs to call the model with")
    call = model.generate if mode == "generate" else model
    with torch.no_grad():
        for _ in range(warm_up):
            call(*args, **kwargs)
        prof = FlopsProfiler(model)
        prof.start_profile(ignore_list=ignore_modules)
        try:
            call(*args, **kwargs)
        finally:
            prof.stop_profile()
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                 detailed=detailed, output_file=output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
