"""`deepspeed.checkpoint.utils`' path under deepfleet (code: `deepfleet.engine.compat.runtime_utils`)."""

from deepfleet.engine.compat.runtime_utils import clone_tensors_for_torch_save  # noqa: F401 - DeepSpeed's path
