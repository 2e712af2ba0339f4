"""`deepspeed.runtime.data_pipeline.data_routing.helper`'s path under deepfleet."""

from deepfleet.engine.data_routing import (  # noqa: F401 - DeepSpeed's path
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)
