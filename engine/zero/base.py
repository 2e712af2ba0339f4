"""The seam between the engine and its sharding strategies: one `ZeroStrategy` per ZeRO stage.

`engine/build.py` picks the strategy for `zero_optimization.stage` and `engine/engine.py` drives it
through these methods only, so the engine never branches on the stage. Implementations:
stage 0 `zero/ddp.py` (DDP), stages 1 and 2 `zero/stage1.py` and `zero/partitioned.py` (our
flat-buffer partitioning), stage 3 `zero/fsdp.py` (FSDP2). `engine/checkpoint/` saves and loads through `state_dict()` /
`load_state_dict()`; `engine/memory.py` accounts memory through `model_state_tensors()`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

# The keys of `model_state_tensors()`, in the order memory reports list them.
MODEL_STATE_CATEGORIES = ("params", "grads", "optimizer", "master")


@runtime_checkable
class ZeroStrategy(Protocol):
    """How one ZeRO stage holds parameters, gradients and optimizer state across data-parallel ranks."""

    module: torch.nn.Module
    """What `engine(batch)` calls: the DDP-wrapped model, the FSDP root, or the model itself."""

    def optimizer_param_groups(self, groups: list[dict]) -> list[dict]:
        """Given the user's param groups over the model's full parameters, return the same groups over
        the tensors the optimizer updates: the params (stage 0, or their fp32 masters in 16-bit mode),
        Shard(0) DTensors of each parameter's rows (stages 1/2: views, or fp32 master shards), FSDP2's
        DTensor shards (stage 3). Hyper-parameters are kept. A group may carry `"process_group"`: the
        group its gradients reduce over (default: the strategy's `process_group`); stages 1/2 shard
        per group and drop the key from what they return.

        Raises ValueError if a group names a tensor that is not a parameter of the model."""
        ...

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Remember the optimizer built over `optimizer_param_groups(...)` (for state and zero_grad)."""
        ...

    def set_gradient_sync(self, enabled: bool) -> None:
        """False on non-boundary micro-steps: no communication, gradients accumulate locally."""
        ...

    def finish_gradients(self, *, grad_scale: float) -> bool:
        """After the boundary micro-step's backward: wait for/issue reductions so the optimizer's tensors
        hold data-parallel-averaged gradients divided by grad_scale (the loss scale). Returns True if any
        rank saw inf/nan (all ranks agree)."""
        ...

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Global L2 norm over all ranks' gradient shards (computed even when max_norm == 0, which means
        no clipping). Returns the pre-clip norm as a python float, identical on every rank."""
        ...

    def after_optimizer_step(self) -> None:
        """Publish the updated weights to the model (master -> 16-bit copy, all-gather at stages 1/2)."""
        ...

    def zero_grad(self) -> None:
        """Drop the gradients of the model and of the optimizer's tensors."""
        ...

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """{"params", "grads", "optimizer", "master"}: every tensor this rank holds for model states, for
        memory accounting (engine/memory.py dedupes by storage and sums storage bytes)."""
        ...

    def state_dict(self) -> dict:
        """{"model": {fqn: Tensor|DTensor}, "optim": {"state": {fqn: {name: Tensor|DTensor}},
        "param_groups": [...]}} in the format of torch.distributed.checkpoint.state_dict.get_state_dict:
        keys are the *original* module's FQNs (no DDP/FSDP prefixes), optimizer state keyed by param FQN.
        Sharded state is a DTensor whose global shape is the parameter's shape, Shard(0) on dim 0 — the
        same layout at stages 1, 2 and 3 — so torch.distributed.checkpoint reshards across world sizes
        and stages."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Load a dict shaped like `state_dict()` (tensors already placed, e.g. by dcp.load in place)."""
        ...


class StrategyFactory(Protocol):
    """How `engine/build.py` constructs every strategy (the classes themselves are the factories).

    The model arrives in fp32, untouched: the strategy casts it to `compute_dtype` for forward/backward
    where that is its way (stages 0-2 keep fp32 master copies of what the optimizer updates; stage 3
    keeps fp32 shards and casts per forward through FSDP2's mixed-precision policy). `zero_config` is
    `DeepFleetConfig.zero_optimization` (bucket sizes, overlap knobs); `process_group` is the
    data-parallel group, None for the default (WORLD)."""

    def __call__(
        self,
        model: torch.nn.Module,
        *,
        compute_dtype: torch.dtype,
        zero_config: Any,
        process_group: Any = None,
    ) -> ZeroStrategy: ...
