"""`deepspeed.runtime.data_pipeline.data_sampling.data_analyzer`'s path under deepfleet."""

from deepfleet.engine.data_sampling import DataAnalyzer  # noqa: F401 - DeepSpeed's path
