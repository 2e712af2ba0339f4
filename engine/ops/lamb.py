"""`deepspeed.ops.lamb`'s path under deepfleet (the class lives in `deepfleet.engine.compat.adam`)."""

from deepfleet.engine.compat.adam import FusedLamb  # noqa: F401 - DeepSpeed's path
