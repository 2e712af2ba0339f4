"""`deepspeed.utils.groups`' path under deepfleet (the accessors live in `deepfleet.engine.compat.groups`)."""

from deepfleet.engine.compat.groups import (  # noqa: F401 - DeepSpeed's path
    _get_broadcast_src_rank,
    _get_data_parallel_group,
    _get_data_parallel_rank,
    _get_data_parallel_world_size,
    _get_expert_data_parallel_group,
    _get_expert_parallel_group,
    _get_expert_parallel_rank,
    _get_expert_parallel_world_size,
    _get_model_parallel_rank,
    _get_model_parallel_world_size,
    _get_sequence_parallel_group,
    _get_sequence_parallel_rank,
    _get_sequence_parallel_world_size,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
