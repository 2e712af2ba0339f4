"""`deepspeed.runtime.data_pipeline.data_sampling.data_sampler`'s path under deepfleet."""

from deepfleet.engine.data_sampling import DeepSpeedDataSampler  # noqa: F401 - DeepSpeed's path
