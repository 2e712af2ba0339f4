"""`deepspeed.utils.zero_to_fp32`'s path under deepfleet (the code lives in `deepfleet.engine.compat.zero_to_fp32`)."""

from deepfleet.engine.compat.zero_to_fp32 import (  # noqa: F401 - DeepSpeed's path
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)
