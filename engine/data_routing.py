"""Random layerwise token dropping (random-LTD, DeepSpeed's `data_efficiency.data_routing.random_ltd`):
the listed blocks see only a random, order-preserving subset of each sequence's tokens; the tokens a
block does not see pass it unchanged (its output keeps their input value). The kept length follows a
schedule that grows to the full sequence, so late training is exact.

Two ways in, one mechanism:
- Configured (`data_efficiency.enabled`, `data_routing.enabled`, `random_ltd.enabled`): the engine
  hooks the listed blocks of `blocks(model)` (a forward pre-hook gathers the kept tokens, a forward hook
  scatters the block's output back). The model is not rewritten, so its state-dict keys, its FSDP2
  units and its exported weights are the plain model's.
- DeepSpeed's `convert_to_random_ltd(model, convert_type)` wraps modules of a class in
  `RandomLayerTokenDrop` (their keys gain `.random_ltd_layer`, as in DeepSpeed;
  `save_without_random_ltd` / `remove_random_ltd_state_dict` strip it).

The kept indices are drawn once per micro-batch and layer from a generator seeded by
`data_efficiency.seed` + rank and advanced per micro-batch, and are reused when activation checkpointing
re-runs a block's forward, so recomputation sees the same tokens. The scheduler's state (kept length,
consumed layer-tokens) travels in checkpoints. torch has no token-dropping routine; the gather/scatter
is a few indexing lines.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

KEY_INFIX = ".random_ltd_layer"


class RandomLTDScheduler:
    """The kept-length schedule (`fixed_linear`, DeepSpeed's rule: floor(s/require_steps * (max - min) + min)
    rounded down to a multiple of `seq_per_step`, capped at max) and the consumed layer-token count."""

    def __init__(self, config: Any, *, global_batch_size: int, seed: int = 1234, rank: int = 0) -> None:
        schedule = config.random_ltd_schedule
        self.min_value, self.max_value = schedule.min_value, schedule.max_value
        self.require_steps = schedule.schedule_config.require_steps
        self.seq_per_step = schedule.schedule_config.seq_per_step
        self.model_layer_num = config.total_layer_num
        self.random_ltd_layer_num = config.random_ltd_layer_num
        self.layer_ids = sorted(config.random_ltd_layer_id)
        self.mask_name = config.model_mask_name
        self.model_type = config.model_type
        self.batch_first = config.hidden_state_order == "batch_seq_dim"
        self.global_batch_size = global_batch_size
        self.current_value = self.min_value
        self.consumed_layer_tokens = 0
        self.current_steps = -1
        self._generator = torch.Generator().manual_seed(seed + rank)
        self._draw_key: object = None
        self._draws: dict[int, tuple[torch.Tensor, Any]] = {}

    # --- the schedule (DeepSpeed's names) --------------------------------------------------------------

    def get_value(self, global_steps: int) -> int:
        value = math.floor(global_steps / self.require_steps * (self.max_value - self.min_value) + self.min_value)
        value -= value % self.seq_per_step
        return min(value, self.max_value)

    def update_seq(self, global_steps: int) -> None:
        """Called before each training forward with the steps taken so far."""
        if self.current_value < self.max_value:
            self.current_value = self.get_value(global_steps)
        if global_steps != self.current_steps:
            self.consumed_layer_tokens += self.global_batch_size * (
                self.current_value * self.random_ltd_layer_num
                + self.max_value * (self.model_layer_num - self.random_ltd_layer_num))
            self.current_steps = global_steps

    def get_current_seq(self) -> int:
        return self.current_value

    def set_current_seq(self, seq_length: int) -> None:
        self.current_value = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_layer_tokens": self.consumed_layer_tokens, "current_steps": self.current_steps,
                "current_value": self.current_value, "min_value": self.min_value, "max_value": self.max_value,
                "generator": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consumed_layer_tokens = int(state["consumed_layer_tokens"])
        self.current_steps = int(state["current_steps"])
        self.current_value = int(state["current_value"])
        if "generator" in state:
            self._generator.set_state(state["generator"])

    # --- the kept tokens --------------------------------------------------------------------------------

    def new_micro_batch(self, key: object) -> None:
        """Start a micro-batch: its layers draw fresh indices once; a recomputed forward reuses them."""
        if key != self._draw_key:
            self._draw_key, self._draws = key, {}

    def indices(self, order: int, batch: int, seq: int, device: torch.device) -> torch.Tensor:
        """Sorted kept positions (batch, kept) for the `order`-th dropping layer of this micro-batch."""
        cached = self._draws.get(order)
        if cached is not None and cached[0].shape == (batch, self.current_value):
            return cached[0].to(device)
        scores = torch.rand(batch, seq, generator=self._generator)
        kept = scores.argsort(dim=1)[:, : self.current_value].sort(dim=1).values
        self._draws[order] = (kept, None)
        return kept.to(device)

    def cut_mask(self, mask: torch.Tensor | None, kept: torch.Tensor) -> torch.Tensor | None:
        """The attention mask over the kept tokens: a decoder's causal mask is cropped (causality among the
        kept, order-preserving tokens is the leading square); an encoder's is gathered at their positions."""
        if mask is None:
            return None
        k = kept.shape[1]
        if self.model_type == "decoder":
            return mask[..., :k, :k]
        # (batch, heads|1, seq, seq) -> rows and columns of each sample's kept positions
        b = kept.shape[0]
        rows = kept.view(b, *([1] * (mask.dim() - 3)), k, 1).expand(*mask.shape[:-2], k, mask.shape[-1])
        gathered = mask.expand(b, *mask.shape[1:]).gather(-2, rows)
        cols = kept.view(b, *([1] * (mask.dim() - 3)), 1, k).expand(*gathered.shape[:-1], k)
        return gathered.gather(-1, cols)

    def active(self, seq: int) -> bool:
        return self.current_value < seq


def gather_tokens(hidden: torch.Tensor, kept: torch.Tensor, batch_first: bool) -> torch.Tensor:
    if not batch_first:
        return gather_tokens(hidden.transpose(0, 1), kept, True).transpose(0, 1)
    return hidden.gather(1, kept.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def scatter_tokens(hidden: torch.Tensor, part: torch.Tensor, kept: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """`hidden` with the kept positions replaced by `part` (autograd: the others pass straight through)."""
    if not batch_first:
        return scatter_tokens(hidden.transpose(0, 1), part.transpose(0, 1), kept, True).transpose(0, 1)
    return hidden.scatter(1, kept.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]), part.to(hidden.dtype))


def _shape(hidden: torch.Tensor, batch_first: bool) -> tuple[int, int]:
    return (hidden.shape[0], hidden.shape[1]) if batch_first else (hidden.shape[1], hidden.shape[0])


class _Dropper:
    """The per-layer forward of random-LTD, shared by the hooks and the wrapper."""

    def __init__(self, scheduler: RandomLTDScheduler, order: int) -> None:
        self.scheduler, self.order = scheduler, order

    def before(self, hidden: torch.Tensor, kwargs: dict) -> tuple[torch.Tensor, dict, torch.Tensor] | None:
        s = self.scheduler
        batch, seq = _shape(hidden, s.batch_first)
        if not s.active(seq):
            return None
        kept = s.indices(self.order, batch, seq, hidden.device)
        if s.mask_name is not None and s.mask_name in kwargs:
            kwargs = {**kwargs, s.mask_name: s.cut_mask(kwargs[s.mask_name], kept)}
        return gather_tokens(hidden, kept, s.batch_first), kwargs, kept

    def after(self, hidden: torch.Tensor, output: Any, kept: torch.Tensor) -> Any:
        first = output[0] if isinstance(output, tuple) else output
        if not isinstance(first, torch.Tensor):
            raise TypeError("random_ltd: a dropping layer must return a tensor or a tuple whose first item is one")
        merged = scatter_tokens(hidden, first, kept, self.scheduler.batch_first)
        return (merged, *output[1:]) if isinstance(output, tuple) else merged


class TokenDropHooks:
    """The configured path: hooks on the listed blocks (the model is not rewritten)."""

    def __init__(self, scheduler: RandomLTDScheduler, layers: list[nn.Module]) -> None:
        self.scheduler = scheduler
        self._handles = []
        self._pending: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for order, layer in enumerate(layers):
            dropper = _Dropper(scheduler, order)
            self._handles.append(layer.register_forward_pre_hook(self._pre(dropper, order), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._post(dropper, order), with_kwargs=True))

    def _pre(self, dropper: _Dropper, order: int):  # noqa: ANN202 - a torch hook
        def hook(module: nn.Module, args: tuple, kwargs: dict):  # noqa: ANN202
            if not module.training or not args or not isinstance(args[0], torch.Tensor):
                return None
            done = dropper.before(args[0], kwargs)
            if done is None:
                return None
            part, kwargs, kept = done
            self._pending.setdefault(order, []).append((args[0], kept))
            return (part, *args[1:]), kwargs
        return hook

    def _post(self, dropper: _Dropper, order: int):  # noqa: ANN202 - a torch hook
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any):  # noqa: ANN202
            stack = self._pending.get(order)
            if not stack:
                return None
            hidden, kept = stack.pop()
            return dropper.after(hidden, output, kept)
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def layers_to_drop(model: nn.Module, config: Any) -> list[nn.Module]:
    """The blocks `random_ltd_layer_id` names, checked against `blocks(model)` and `total_layer_num`."""
    from deepfleet.engine.blocks import blocks

    found = blocks(model)
    if len(found) != config.total_layer_num:
        raise ValueError(f"data_efficiency.data_routing.random_ltd.total_layer_num: {config.total_layer_num}, the "
                         f"model has {len(found)} blocks; set it to {len(found)}")
    return [found[i] for i in sorted(config.random_ltd_layer_id)]


# --- DeepSpeed's wrapper API ----------------------------------------------------------------------------


class RandomLayerTokenDrop(nn.Module):
    """DeepSpeed's wrapper: `layer` sees only the kept tokens once `init_config` bound it to a scheduler
    (the engine's `random_ltd_initialize()` does, for wrappers under its model)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler: RandomLTDScheduler | None = None
        self._dropper: _Dropper | None = None

    def init_config(self, config: Any, scheduler: RandomLTDScheduler, random_ltd_layer_id: int) -> None:
        del config  # the scheduler carries the section
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self._dropper = _Dropper(scheduler, random_ltd_layer_id)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.training and self._dropper is not None:
            done = self._dropper.before(hidden_states, kwargs)
            if done is not None:
                part, kwargs, kept = done
                return self._dropper.after(hidden_states, self.random_ltd_layer(part, *args, **kwargs), kept)
        return self.random_ltd_layer(hidden_states, *args, **kwargs)


def convert_to_random_ltd(model: nn.Module, convert_type: type) -> nn.Module:
    """Wrap every `convert_type` module of `model` (or of an engine's `.module`) in RandomLayerTokenDrop,
    then bind the wrappers to the engine's scheduler when `model` is an engine."""
    target = model.module if hasattr(model, "module") else model
    for name, module in list(target.named_modules()):
        if isinstance(module, convert_type) and name:
            parent_name, _, child = name.rpartition(".")
            parent = target.get_submodule(parent_name) if parent_name else target
            setattr(parent, child, RandomLayerTokenDrop(module))
    if hasattr(model, "random_ltd_initialize"):
        model.random_ltd_initialize()
    return model


def bind_wrappers(model: nn.Module, scheduler: RandomLTDScheduler) -> int:
    """Bind the RandomLayerTokenDrop wrappers that `random_ltd_layer_id` lists (by position among the
    wrappers, in module order) to `scheduler`; return how many were bound."""
    wrappers = [m for m in model.modules() if isinstance(m, RandomLayerTokenDrop)]
    wanted = scheduler.layer_ids
    if wanted and max(wanted) >= len(wrappers):
        raise ValueError(f"data_efficiency.data_routing.random_ltd.random_ltd_layer_id: {wanted} but the model has "
                         f"{len(wrappers)} RandomLayerTokenDrop layers; list indices below {len(wrappers)}")
    for order, index in enumerate(wanted):
        wrappers[index].init_config(None, scheduler, order)
    return len(wanted)


def remove_random_ltd_state_dict(state_dict: dict) -> OrderedDict:
    """A state dict's keys without the wrappers' `.random_ltd_layer` (the plain model's keys)."""
    return OrderedDict((key.replace(KEY_INFIX, ""), value) for key, value in state_dict.items())


def save_without_random_ltd(model: nn.Module) -> OrderedDict:
    target = model.module if hasattr(model, "module") else model
    return remove_random_ltd_state_dict(target.state_dict())
