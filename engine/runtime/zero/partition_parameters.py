"""`deepspeed.runtime.zero.partition_parameters`' path under deepfleet (code: `deepfleet.engine.compat.zero`)."""

from deepfleet.engine.compat.accelerator import get_accelerator  # noqa: F401 - DeepSpeed's module has it
from deepfleet.engine.compat.zero import (  # noqa: F401 - DeepSpeed's path
    GatheredParameters,
    Init,
    ZeroParamStatus,
    _orig_torch_arange,
    zero_wrapper_for_fp_tensor_constructor,
)
