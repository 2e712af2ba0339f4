"""The `eigenvalue` section: the dominant eigenvalue of each block's loss Hessian, estimated by power
iteration on Hessian-vector products (`torch.autograd.grad` twice; no Hessian is ever formed).

DeepSpeed's `Eigenvalue` (the names, keys and defaults are its) fed the result to its quantization
schedule and has since been retired with it; here the figure is reported for what it is, the local
curvature of each block (large values: a sharp block that tolerates less learning rate or precision),
on `engine.block_eigenvalue` and in the step metrics' `block_eigenvalues`. torch has no such estimator;
the loop is a few lines over autograd.

Two ways in:
- The engine (`eigenvalue.enabled`): on every `gas_boundary_resolution`-th optimizer step, the boundary
  micro-batch's forward runs with the math attention kernel (the fused CPU/GPU kernels have no double
  backward) and `engine.backward(loss)` estimates every block's eigenvalue from that loss before the
  ordinary backward. The estimates are averaged over the data-parallel group, so every rank reports
  the same numbers. ZeRO stage 3 is refused: FSDP2's gathers are not twice differentiable.
- `Eigenvalue(...).compute_eigenvalue(module)` as DeepSpeed scripts call it, after their own
  `loss.backward(create_graph=True)`: it reads the blocks' `.grad` (which then carry a graph).

Result shape (DeepSpeed's): `{block_index: [eigenvalue, block_index]}`, the eigenvalues divided by the
largest magnitude among the blocks (in [-1, 1]; a block whose estimate is 0 or not finite reports 1.0).
The raw estimates are `Eigenvalue.last_raw`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

from deepfleet.engine.blocks import _get_path, blocks

logger = logging.getLogger(__name__)

DEFAULT_LAYER_NAME = "bert.encoder.layer"


class Eigenvalue:
    """Power iteration per block (`max_iter`, `tol`, `stability` with DeepSpeed's meanings)."""

    def __init__(self, verbose: bool = False, max_iter: int = 100, tol: float = 1e-2, stability: float = 1e-6,
                 gas_boundary_resolution: int = 1, layer_name: str = DEFAULT_LAYER_NAME, layer_num: int = 0) -> None:
        self.verbose = verbose
        self.max_iter = max_iter
        self.tol = tol
        self.stability = stability
        self.gas_boundary_resolution = gas_boundary_resolution
        self.layer_name = layer_name
        self.layer_num = layer_num
        self.last_raw: list[float] = []
        self.last_iterations: list[int] = []

    @classmethod
    def from_config(cls, section) -> Eigenvalue:  # noqa: ANN001 - engine.config_curriculum.EigenvalueConfig
        return cls(verbose=section.verbose, max_iter=section.max_iter, tol=section.tol, stability=section.stability,
                   gas_boundary_resolution=section.gas_boundary_resolution, layer_name=section.layer_name,
                   layer_num=section.layer_num)

    # --- which blocks ---------------------------------------------------------------------------------

    def blocks_of(self, module: nn.Module) -> list[nn.Module]:
        """`layer_name`'s children (the first `layer_num`, 0 = all); DeepSpeed's default path falls back
        to the engine's block discovery when the model has no such submodule."""
        found = _get_path(module, self.layer_name)
        if found is None:
            if self.layer_name != DEFAULT_LAYER_NAME:
                raise ValueError(f"eigenvalue.layer_name: the model has no submodule {self.layer_name!r}; set it to "
                                 "the dotted path of the block list (e.g. \"transformer.h\") or leave it unset")
            listed: Sequence[nn.Module] = blocks(module)
        elif isinstance(found, nn.Module) and isinstance(found, (nn.ModuleList, nn.Sequential)):
            listed = list(found)
        elif isinstance(found, nn.Module):
            listed = [found]
        else:
            raise ValueError(f"eigenvalue.layer_name: {self.layer_name!r} is not a module; set it to the dotted path "
                             "of the block list")
        if not listed:
            raise ValueError("eigenvalue.layer_name: the model has no repeated blocks to estimate; set layer_name to "
                             "the dotted path of its block list")
        if self.layer_num > len(listed):
            raise ValueError(f"eigenvalue.layer_num: {self.layer_num} blocks asked, the model has {len(listed)}; "
                             f"set it to at most {len(listed)} (0 = all)")
        return list(listed[: self.layer_num or len(listed)])

    # --- the estimate -------------------------------------------------------------------------------

    def _power_iteration(self, grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                         generator: torch.Generator) -> tuple[float, int]:
        """The dominant eigenvalue of d(grads)/d(params) (a Hessian block), and the iterations it took."""
        v = [torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.device, p.dtype) for p in params]
        v = self._normalized(v)
        estimate, previous = 0.0, None
        for i in range(1, self.max_iter + 1):
            hv = torch.autograd.grad(grads, params, grad_outputs=v, retain_graph=True, allow_unused=True)
            hv = [torch.zeros_like(p) if h is None else h.detach() for h, p in zip(hv, params, strict=True)]
            estimate = float(sum((h.float() * x.float()).sum() for h, x in zip(hv, v, strict=True)))  # Rayleigh quotient
            v = self._normalized(hv)
            if previous is not None and abs(estimate - previous) <= self.tol * (abs(estimate) + self.stability):
                return estimate, i
            previous = estimate
        return estimate, self.max_iter

    def _normalized(self, vectors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        norm = math.sqrt(float(sum(x.float().pow(2).sum() for x in vectors))) + self.stability
        return [x / norm for x in vectors]

    def block_eigenvalues(self, loss: torch.Tensor, module: nn.Module, *, seed: int = 0,
                          group: object | None = None) -> dict[int, list[float]]:
        """Estimate every block's eigenvalue of `loss`'s Hessian (the graph is kept for the caller's
        backward), averaged over `group` when given."""
        grads_and_params = []
        for block in self.blocks_of(module):
            params = [p for p in block.parameters() if p.requires_grad]
            if not params:
                grads_and_params.append(None)
                continue
            grads = torch.autograd.grad(loss, params, create_graph=True, retain_graph=True, allow_unused=True)
            kept = [(g, p) for g, p in zip(grads, params, strict=True) if g is not None and g.requires_grad]
            grads_and_params.append(([g for g, _ in kept], [p for _, p in kept]) if kept else None)
        return self._estimate(grads_and_params, seed=seed, group=group)

    def compute_eigenvalue(self, module: nn.Module, device: torch.device | str | None = None,
                           scale: float = 1.0) -> dict[int, list[float]]:
        """DeepSpeed's call, after `loss.backward(create_graph=True)`: the blocks' `.grad` carry the graph.
        `scale` is the loss scale the loss was multiplied by (the estimates are divided by it)."""
        del device  # the estimate runs where the parameters are
        grads_and_params = []
        for block in self.blocks_of(module):
            kept = [(p.grad, p) for p in block.parameters()
                    if p.requires_grad and p.grad is not None and p.grad.requires_grad]
            grads_and_params.append(([g for g, _ in kept], [p for _, p in kept]) if kept else None)
        if all(entry is None for entry in grads_and_params):
            raise ValueError("compute_eigenvalue: the blocks' gradients carry no graph; call "
                             "loss.backward(create_graph=True) first")
        return self._estimate(grads_and_params, seed=0, group=None, scale=scale)

    def _estimate(self, grads_and_params: list, *, seed: int, group: object | None,
                  scale: float = 1.0) -> dict[int, list[float]]:
        generator = torch.Generator().manual_seed(seed)
        raw, iterations = [], []
        for entry in grads_and_params:
            if entry is None:
                raw.append(0.0)
                iterations.append(0)
                continue
            value, its = self._power_iteration(entry[0], entry[1], generator)
            raw.append(value / scale)
            iterations.append(its)
        if group is not None:
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_world_size(group) > 1:
                from deepfleet.engine import comm

                t = torch.tensor(raw, dtype=torch.float64)
                comm.all_reduce(t, group=group, log_name="eigenvalue")
                raw = (t / dist.get_world_size(group)).tolist()
        self.last_raw, self.last_iterations = raw, iterations
        if self.verbose:
            for i, (value, its) in enumerate(zip(raw, iterations, strict=True)):
                logger.info("eigenvalue: block %d: %.6g after %d iterations", i, value, its)
        return normalized(raw)


def normalized(raw: Sequence[float]) -> dict[int, list[float]]:
    """DeepSpeed's result shape: each block's eigenvalue over the largest magnitude, 1.0 where unknown."""
    finite = [abs(x) for x in raw if math.isfinite(x)]
    top = max(finite, default=0.0)
    out: dict[int, list[float]] = {}
    for i, x in enumerate(raw):
        out[i] = [x / top if top > 0 and math.isfinite(x) and x != 0 else 1.0, i]
    return out
