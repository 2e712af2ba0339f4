"""`deepspeed.runtime.data_pipeline.data_routing.scheduler`'s path under deepfleet."""

from deepfleet.engine.data_routing import RandomLTDScheduler  # noqa: F401 - DeepSpeed's path
