"""`deepspeed.runtime.dataloader`'s path under deepfleet."""

from deepfleet.engine.compat.loader import RepeatingLoader  # noqa: F401 - DeepSpeed's path
