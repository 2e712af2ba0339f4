"""`deepspeed.runtime.engine`'s path under deepfleet: the engine class under DeepSpeed's name."""

from deepfleet.engine.engine import DeepFleetEngine as DeepSpeedEngine  # noqa: F401 - DeepSpeed's path
