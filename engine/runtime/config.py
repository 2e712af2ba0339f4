"""`deepspeed.runtime.config`'s path under deepfleet."""

from deepfleet.engine.compat.config import DeepSpeedConfig  # noqa: F401 - DeepSpeed's path
