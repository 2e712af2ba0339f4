"""`deepspeed.runtime.activation_checkpointing.checkpointing`'s path under deepfleet: the same names as
`deepspeed.checkpointing` (`deepfleet.engine.checkpointing`; the code lives in
`deepfleet.engine.compat.checkpointing`)."""

from deepfleet.engine.checkpointing import *  # noqa: F403 - DeepSpeed serves one module at both paths
