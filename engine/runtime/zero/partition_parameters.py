"""`deepspeed.runtime.zero.partition_parameters`' path under deepfleet (code: `deepfleet.engine.compat.zero`)."""

from deepfleet.engine.compat.zero import GatheredParameters, Init, ZeroParamStatus  # noqa: F401 - DeepSpeed's path
