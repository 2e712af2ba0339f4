"""The `communication` config section (deepfleet's own key): compression of the data-parallel gradient
reduction of every ZeRO stage (0, 1 and 2 through their flat buffers, 3 through FSDP2's reduce-scatter hook),
and its convergence guard.

Read by `engine/build.py`, which builds `engine/gradcomp/policy.py`'s policy from it. Torch-free, beside
config.py for the reason config_zero.py is (the controller validates engine configs).

```json
"communication": {"compression": "int8", "block_size": 256, "error_feedback": true,
                  "guard": {"interval": 100, "max_relative_error": 0.5}}
```
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from deepfleet.engine.config_base import Bool, ConfigSection, Float, Int


class GuardConfig(ConfigSection):
    """Every `interval` steps, each compressed reduction also runs uncompressed on the same bucket."""

    interval: Int = Field(100, ge=0)
    """Steps between checks (0: never check)."""
    max_relative_error: Float = Field(0.5, gt=0.0)
    """Fall back to uncompressed reductions when ||compressed - exact|| / ||exact|| of a checked bucket
    exceeds this."""
    max_loss_increase: Float = Field(0.5, gt=0.0)
    """Fall back when the loss at a check exceeds the loss at the previous check by more than this
    fraction of it."""


class CommunicationConfig(ConfigSection):
    """`communication`: how gradients cross the wire."""

    compression: Literal["none", "int8", "int4"] = "none"
    """Block quantization of the gradient reduction: int8 (~0.38 of fp32's bytes on 2 ranks) or int4 (~0.2)."""
    block_size: Int = Field(256, gt=0, multiple_of=2)
    """Elements per quantization scale."""
    error_feedback: Bool = True
    """Carry what quantization dropped into the next step's reduction of the same bucket."""
    guard: GuardConfig = Field(default_factory=GuardConfig)
    """The convergence guard."""
