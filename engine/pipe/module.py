"""DeepSpeed's pipeline model description: `PipelineModule`, `LayerSpec`, `TiedLayerSpec`.

Built by the user's script before `deepfleet.engine.initialize(model=PipelineModule(...))` (the
process group must exist, as in DeepSpeed); `engine/pipe/engine.py` runs it. The model is a list of
layers fed one into the next (a layer's output, a tensor or a tuple, is the next layer's input); this
rank builds only the layers of its own stage(s), so pipeline memory scales with the stage.

Stage placement follows the mesh (`engine/parallel.py`): `pp` is the outermost axis, so the stage of
global rank r is r // (world_size // num_stages). With a schedule of several model chunks per rank
(`schedule=` Interleaved1F1B / InterleavedZeroBubble: `virtual_stages` chunks, round robin; ZBV /
DualPipeV: two chunks in a V), the layer list is split into num_stages * chunks parts and rank s holds
parts s, s + num_stages, ... (loop) or s and 2 * num_stages - 1 - s (V).

Parameter names do not depend on the split: layer i's parameters are `"<i>.<name>"` and a tied
module's are `"tied_modules.<key>.<name>"` (DeepSpeed's names), so a checkpoint saved at one pipeline
depth loads at another. A tied module is built on every stage that uses it; `engine/pipe/tied.py` makes
the copies equal at `initialize` and sums their gradients.

Deviations from DeepSpeed, by name: `partition_method="profile"` is implemented (DeepSpeed raises
NotImplementedError) and needs `profile_input=`; `activation_checkpoint_func` defaults to
torch.utils.checkpoint (non-reentrant); `schedule`/`virtual_stages` are deepfleet's. The positional
order of DeepSpeed's arguments is kept, so scripts that pass them positionally still work.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from deepfleet.engine import comm
from deepfleet.engine.config_pipeline import SCHEDULE_CHUNKS, SCHEDULES
from deepfleet.engine.pipe.partition import layer_weights, partition


class LayerSpec:
    """A layer to build later, on the stage that owns it: `typename(*module_args, **module_kwargs)`."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec: {typename!r} is not a torch.nn.Module class; pass the class itself")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        """Construct the layer."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose weights (`tied_weight_attr`, dotted attribute names) are shared by every spec with
    the same `key` (tied embeddings); `forward_fn(module, inputs)` replaces `module(inputs)` when given."""

    def __init__(
        self, key: str, typename: type, *module_args: Any, forward_fn: Callable | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",), **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


@dataclass
class _Entry:
    """One layer of a chunk: its global index and how to call it."""

    index: int
    call: Callable[[Any], Any]
    module: nn.Module | None  # None for a plain function
    name: str  # class or function name (checkpointable_layers, logging)


class StageChunk(nn.Module):
    """The contiguous layers of one pipeline part, run in order (what one PipelineStage wraps). Its
    children are the same modules the PipelineModule registers, so parameters are shared."""

    def __init__(self, entries: list[_Entry], *, part: int, ac_interval: int, ac_func: Callable,
                 checkpointable: Sequence[str] | None) -> None:
        super().__init__()
        self.part = part
        self._entries = entries
        self._ac_interval = ac_interval
        self._ac_func = ac_func
        self._checkpointable = None if checkpointable is None else set(checkpointable)
        seen: set[int] = set()
        for e in entries:
            if e.module is not None and id(e.module) not in seen:
                seen.add(id(e.module))
                self.add_module(f"layer{e.index}", e.module)

    def _run(self, entries: list[_Entry], x: Any) -> Any:
        for e in entries:
            x = e.call(x)
        return x

    def _can_checkpoint(self, run: list[_Entry]) -> bool:
        has_params = any(e.module is not None and any(True for _ in e.module.parameters()) for e in run)
        names_ok = self._checkpointable is None or all(e.name in self._checkpointable for e in run)
        return has_params and names_ok and torch.is_grad_enabled()

    def forward(self, *args: Any) -> Any:
        x: Any = args[0] if len(args) == 1 else args
        if self._ac_interval <= 0:
            return self._run(self._entries, x)
        for start in range(0, len(self._entries), self._ac_interval):
            run = self._entries[start:start + self._ac_interval]
            if not self._can_checkpoint(run):
                x = self._run(run, x)
                continue
            inputs = x if isinstance(x, tuple) else (x,)
            x = self._ac_func(lambda *xs, run=run: self._run(run, xs[0] if len(xs) == 1 else xs), *inputs)
        return x


def _non_reentrant(fn: Callable, *args: Any) -> Any:
    return torch_checkpoint(fn, *args, use_reentrant=False)


def _layer_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def chunk_parts(stage: int, *, num_stages: int, chunks: int, layout: str) -> list[int]:
    """The part indices rank-stage `stage` holds (see the module docstring), in execution order."""
    if layout == "v":
        return [stage, 2 * num_stages - 1 - stage]
    return [stage + k * num_stages for k in range(chunks)]


class PipelineModule(nn.Module):
    """A sequence of layers split into pipeline stages (see the module docstring)."""

    deepfleet_pipeline = True  # `initialize` hands a model with this flag to the pipeline engine

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable | None = None,
        checkpointable_layers: Sequence[str] | None = None,
        dynamic_shape: bool = False,
        *,
        schedule: str | None = None,
        virtual_stages: int | None = None,
        profile_input: Any = None,
    ) -> None:
        super().__init__()
        if num_stages is None and topology is None:
            raise ValueError("num_stages: required; pass num_stages=<pipeline stages> (or topology=)")
        if num_stages is None:
            num_stages = int(topology.get_dim("pipe"))
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"num_stages: must be a positive integer, got {num_stages!r}")
        if schedule is not None and schedule not in SCHEDULES:
            raise ValueError(f"schedule: unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
        self.loss_fn = loss_fn
        self.num_stages = num_stages
        self.schedule = schedule
        self.partition_method = partition_method
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.dynamic_shape = dynamic_shape
        fixed, self.layout = SCHEDULE_CHUNKS[schedule or "1F1B"]
        chunks = fixed if fixed is not None else (virtual_stages or 2)
        if fixed is not None and virtual_stages not in (None, fixed):
            raise ValueError(f"virtual_stages: schedule {schedule} runs {fixed} chunk(s) per rank, got {virtual_stages}")
        if chunks < 1:
            raise ValueError(f"virtual_stages: must be a positive integer, got {chunks}")
        self.chunks_per_rank = chunks
        self._specs = list(layers.children()) if isinstance(layers, nn.Sequential) else list(layers)
        names = [_layer_name(layer) for layer in self._specs]
        num_parts = num_stages * chunks
        weights = layer_weights(
            partition_method, names=names, param_counts=self._count_params,
            times=lambda: self._measure_times(profile_input),
        )
        self.parts = partition(len(self._specs), num_parts, weights)  # part p = layers [parts[p], parts[p+1])
        world, rank = (comm.get_world_size(), comm.get_rank()) if comm.is_initialized() else (1, 0)
        if world % num_stages:
            raise ValueError(
                f"num_stages: {num_stages} does not divide the world size {world}; use a divisor of {world}"
            )
        self.stage_id = rank // (world // num_stages)
        self.local_parts = chunk_parts(self.stage_id, num_stages=num_stages, chunks=chunks, layout=self.layout)
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.tied_first_layer: dict[str, int] = {}  # key -> the first layer index that uses it
        seed = seed_fn or (lambda i: torch.manual_seed(base_seed + i))
        ac_func = activation_checkpoint_func or _non_reentrant
        self.stage_chunks: list[StageChunk] = []
        built: dict[int, _Entry] = {}
        for part in self.local_parts:
            entries = []
            for i in range(self.parts[part], self.parts[part + 1]):
                if i not in built:
                    built[i] = self._build(i, seed if seed_layers else None)
                entries.append(built[i])
            chunk = StageChunk(entries, part=part, ac_interval=self.activation_checkpoint_interval,
                               ac_func=ac_func, checkpointable=checkpointable_layers)
            # not registered as children: parameters are registered once, under stage-independent names
            self.stage_chunks.append(chunk)

    # -- building --------------------------------------------------------------------------------

    def _build(self, i: int, seed: Callable[[int], Any] | None) -> _Entry:
        spec = self._specs[i]
        name = _layer_name(spec)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:
                if seed is not None:
                    seed(self._first_use(spec.key))
                self.tied_modules[spec.key] = spec.build()
                self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                self.tied_first_layer[spec.key] = self._first_use(spec.key)
            module = self.tied_modules[spec.key]
            fn = spec.forward_fn
            call = (lambda x, m=module, f=fn: f(m, x)) if fn is not None else module
            return _Entry(i, call, module, name)
        if isinstance(spec, LayerSpec):
            if seed is not None:
                seed(i)
            module = spec.build()
        elif isinstance(spec, nn.Module):
            module = spec
        elif callable(spec):
            return _Entry(i, spec, None, name)
        else:
            raise TypeError(f"layers[{i}]: {spec!r} is not a module, a LayerSpec or a callable")
        self.add_module(str(i), module)
        return _Entry(i, module, module, name)

    def _first_use(self, key: str) -> int:
        return next(i for i, s in enumerate(self._specs) if isinstance(s, TiedLayerSpec) and s.key == key)

    def tied_stages(self) -> dict[str, list[int]]:
        """Tie key -> the pipeline stages (pp ranks) whose parts use it, ascending."""
        out: dict[str, set[int]] = {}
        for stage in range(self.num_stages):
            for part in chunk_parts(stage, num_stages=self.num_stages, chunks=self.chunks_per_rank,
                                    layout=self.layout):
                for i in range(self.parts[part], self.parts[part + 1]):
                    spec = self._specs[i]
                    if isinstance(spec, TiedLayerSpec):
                        out.setdefault(spec.key, set()).add(stage)
        return {k: sorted(v) for k, v in out.items()}

    def _count_params(self) -> list[int]:
        counts = []
        for spec in self._specs:
            module = spec.build() if isinstance(spec, LayerSpec) else spec
            params = module.parameters() if isinstance(module, nn.Module) else ()
            counts.append(sum(p.numel() for p in params if p.requires_grad))
        return counts

    def _measure_times(self, sample: Any) -> list[float]:
        """Seconds of forward + backward of each layer on `sample` (the first layer's input), the median
        of three runs, averaged over all ranks so every rank partitions alike."""
        if sample is None:
            raise ValueError("profile_input: partition_method='profile' needs profile_input=<a sample batch input>")
        modules = [s.build() if isinstance(s, LayerSpec) else s for s in self._specs]
        times = []
        x = sample
        for layer in modules:
            runs = []
            for _ in range(3):
                inputs = tuple(t.detach().requires_grad_(t.is_floating_point())
                               for t in (x if isinstance(x, tuple) else (x,)))
                start = time.perf_counter()
                out = layer(inputs[0] if len(inputs) == 1 else inputs)
                outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o.requires_grad]
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
                runs.append(time.perf_counter() - start)
            times.append(sorted(runs)[1])
            x = tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()
        if comm.is_initialized() and comm.get_world_size() > 1:
            totals = torch.tensor(times, dtype=torch.float64)
            comm.all_reduce(totals)
            times = (totals / comm.get_world_size()).tolist()
        return times

    # -- running ---------------------------------------------------------------------------------

    def forward(self, *args: Any) -> Any:
        """Run this rank's layers (one chunk per rank only; the pipeline engine drives the chunks)."""
        if len(self.stage_chunks) != 1:
            raise RuntimeError("PipelineModule: this rank holds several chunks; run it through engine.train_batch")
        return self.stage_chunks[0](*args)

    def topology(self) -> Any:
        return None
