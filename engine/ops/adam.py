"""`deepspeed.ops.adam`'s path under deepfleet (the classes live in `deepfleet.engine.compat.adam`)."""

from deepfleet.engine.compat.adam import DeepSpeedCPUAdam, FusedAdam  # noqa: F401 - DeepSpeed's path
