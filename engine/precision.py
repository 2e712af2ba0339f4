"""Numeric precision of training: the compute dtype and, for fp16, the loss scaler.

`engine/build.py` builds one `Precision` from the config; the strategies read `compute_dtype` (they keep
fp32 masters themselves) and `engine/engine.py` calls `scale_loss` in backward, passes `loss_scale` to
`finish_gradients`, and asks `update(overflow)` whether to apply the optimizer step.

The dynamic scaler is our own: `torch.amp.GradScaler` unscales per optimizer and decides per step from
its own inf checks, while DeepSpeed's fp16 semantics (which configs in the wild rely on) are a loss
scale that halves only after `hysteresis` overflows, doubles after `loss_scale_window` overflow-free
steps, never falls below `min_loss_scale`, and skips (but counts) overflowed steps. Those semantics:

- start at 2**initial_scale_power;
- on overflow: if the hysteresis budget is down to 1, halve (floored at min_loss_scale); otherwise
  spend one unit of hysteresis and keep the scale;
- on a good step: if `consecutive_hysteresis`, refill the hysteresis budget; every `loss_scale_window`
  good steps since the last overflow, double the scale (and refill the budget when not consecutive).

bf16 and fp32 need no scaling: their scale is 1 and every step is applied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass
class DynamicLossScaler:
    """fp16 loss scale that adapts to overflows (semantics in the module docstring)."""

    scale: float
    window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float
    factor: float = 2.0
    hysteresis_left: int = 0
    iteration: int = 0
    last_overflow_iteration: int = -1

    def __post_init__(self) -> None:
        if self.hysteresis_left == 0:
            self.hysteresis_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        """Account one optimizer step (overflowed or not) and adapt the scale."""
        if overflow:
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "hysteresis_left": self.hysteresis_left,
            "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])


@dataclass
class StaticLossScaler:
    """A fixed loss scale (fp16 with `loss_scale` > 0; 1.0 for bf16/fp32)."""

    scale: float

    def update(self, overflow: bool) -> None:
        """A static scale never changes."""

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class Precision:
    """Compute dtype + loss scaling + the skip-on-overflow rule, as one object the engine sequences."""

    def __init__(
        self,
        compute_dtype: torch.dtype,
        *,
        scaler: DynamicLossScaler | StaticLossScaler,
        skip_on_overflow: bool,
        cast_inputs: bool = False,
    ) -> None:
        self.compute_dtype = compute_dtype
        self.scaler = scaler
        self.skip_on_overflow = skip_on_overflow
        self.cast_inputs = cast_inputs

    def prepare_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The forward's inputs, floating-point tensors cast to the compute dtype when the policy
        casts inputs (`fp16.auto_cast`); unchanged otherwise."""
        if not self.cast_inputs:
            return args, kwargs
        return _cast_floats(args, self.compute_dtype), _cast_floats(kwargs, self.compute_dtype)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate: multiplied by the current loss scale (1 for bf16/fp32)."""
        return loss * self.scaler.scale if self.scaler.scale != 1.0 else loss

    def update(self, overflow: bool) -> bool:
        """Account one boundary step; return True if the optimizer step should be applied.

        fp16 skips an overflowed step (its gradients are inf/nan) and adapts the scale; bf16/fp32 apply
        every step, as DeepSpeed does."""
        if not self.skip_on_overflow:
            return True
        before = self.scaler.scale
        self.scaler.update(overflow)
        if overflow:
            logger.warning(
                "fp16 gradient overflow: optimizer step skipped; loss scale %g -> %g", before, self.scaler.scale
            )
        return not overflow

    def state_dict(self) -> dict[str, Any]:
        return {"loss_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scaler.load_state_dict(state["loss_scaler"])


def _cast_floats(x: Any, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors inside nested dicts/lists/tuples (a batch) to `dtype`."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _cast_floats(v, dtype) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_floats(v, dtype) for v in x)
    return x


def build_precision(config: Any) -> Precision:
    """The precision policy for a resolved `DeepFleetConfig` (its `fp16` and `bf16` sections)."""
    fp16, bf16 = config.fp16, config.bf16
    if fp16 is not None and fp16.enabled:
        if fp16.loss_scale > 0:
            scaler: DynamicLossScaler | StaticLossScaler = StaticLossScaler(float(fp16.loss_scale))
        else:
            scaler = DynamicLossScaler(
                scale=float(2**fp16.initial_scale_power),
                window=int(fp16.loss_scale_window),
                hysteresis=int(fp16.hysteresis),
                consecutive_hysteresis=bool(fp16.consecutive_hysteresis),
                min_scale=float(fp16.min_loss_scale),
            )
        return Precision(torch.float16, scaler=scaler, skip_on_overflow=True, cast_inputs=bool(fp16.auto_cast))
    dtype = torch.bfloat16 if bf16 is not None and bf16.enabled else torch.float32
    return Precision(dtype, scaler=StaticLossScaler(1.0), skip_on_overflow=False)
