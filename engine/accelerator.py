"""`deepspeed.accelerator`'s path under deepfleet: `from deepfleet.engine.accelerator import get_accelerator`.
The adapter is `deepfleet.engine.compat.accelerator`."""

from deepfleet.engine.compat.accelerator import (  # noqa: F401 - re-exported at DeepSpeed's path
    CPUAccelerator,
    CUDAAccelerator,
    DeepFleetAccelerator,
    get_accelerator,
    set_accelerator,
)
