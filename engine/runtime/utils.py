"""`deepspeed.runtime.utils`' path under deepfleet (the code lives in `deepfleet.engine.compat.runtime_utils`)."""

from deepfleet.engine.compat.runtime_utils import move_to_device, see_memory_usage, set_random_seed  # noqa: F401
