"""`deepspeed.ops.lion`'s path under deepfleet (the class lives in `deepfleet.engine.compat.adam`)."""

from deepfleet.engine.compat.adam import FusedLion  # noqa: F401 - DeepSpeed's path
