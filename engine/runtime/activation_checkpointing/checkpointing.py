"""`deepspeed.runtime.activation_checkpointing.checkpointing`'s path under deepfleet (the code lives in
`deepfleet.engine.compat.checkpointing`)."""

from deepfleet.engine.compat.checkpointing import (  # noqa: F401 - re-exported at DeepSpeed's path
    CudaRNGStatesTracker,
    checkpoint,
    configure,
    get_cuda_rng_tracker,
    is_configured,
    model_parallel_cuda_manual_seed,
    non_reentrant_checkpoint,
    partition_activations_in_checkpoint,
    reset,
    set_num_layers,
)
