"""`deepspeed.runtime.data_pipeline.data_routing.basic_layer`'s path under deepfleet."""

from deepfleet.engine.data_routing import RandomLayerTokenDrop  # noqa: F401 - DeepSpeed's path
