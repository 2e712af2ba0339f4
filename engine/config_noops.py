"""Config keys the engine accepts but that change nothing here, each with the reason.

Read by the tests (tests/engine/test_config_noops.py), which hold this table, the no-op table in
`docs/engine.md` and the code to each other: an entry whose `stages` is None must not be read by any
engine/worker code, every config field that no code reads must have such an entry, and the docs list
exactly these keys. A key is accepted as a no-op only when DeepSpeed's behaviour at every value is
what this engine does anyway (or the difference is performance only); a key whose effect matters and
is missing is refused as "not supported yet" instead (`config_keys.NOT_SUPPORTED`). When a strategy
starts reading one of these keys, delete its entry. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NoOp:
    """Why a key changes nothing; `stages`: only at these ZeRO stages (None: at every stage)."""

    reason: str
    stages: tuple[int, ...] | None = None


NO_OPS: dict[str, NoOp] = {
    # checkpoint section (engine/config_checkpoint.py)
    "checkpoint.load_universal": NoOp(
        "DeepSpeed's switch to load a topology-independent checkpoint; every checkpoint here is one (DCP with "
        "global shapes), so both values load the same way."
    ),
    "checkpoint.use_node_local_storage": NoOp(
        "Only false is accepted (its validator refuses true): shards always go to the one directory given."
    ),
    "checkpoint.parallel_write.pipeline_stage": NoOp(
        "How DeepSpeed spreads pipeline stages' writes; every rank writes its own shard files here."
    ),
    # elasticity (engine/elasticity.py)
    "elasticity.min_time": NoOp(
        "Minutes a scheduler should keep an elastic job at one size before rescaling it; DeepSpeed's runtime "
        "does not read it either, and the batch arithmetic does not depend on it."
    ),
    # sequence parallelism (engine/attention/)
    "seq_parallel_communication_data_type": NoOp(
        "DeepSpeed's dtype for reducing gradients over the data- and sequence-parallel ranks; every strategy "
        "here reduces gradients in fp32 over that group, which is at least as accurate at every value."
    ),
    # pipeline parallelism (engine/pipe/)
    "pipeline.pipe_partitioned": NoOp(
        "DeepSpeed splits the activations sent between pipeline stages over its tensor-parallel ranks; the pipeline engine runs without tensor parallelism, where the split is the whole tensor."
    ),
    "pipeline.grad_partitioned": NoOp(
        "DeepSpeed splits the gradients sent between pipeline stages over its tensor-parallel ranks; the pipeline engine runs without tensor parallelism, where the split is the whole tensor."
    ),
    # zero_optimization, stages 1/2: our own partitioning (zero/partitioned.py)
    "zero_optimization.contiguous_gradients": NoOp(
        "Stages 1/2 always pack gradients into flat bucket buffers (contiguous by construction); stage 3 "
        "leaves gradient buffers to FSDP2."
    ),
    "zero_optimization.reduce_scatter": NoOp(
        "false asks DeepSpeed for all-reduce instead of reduce-scatter; each rank ends with the same averaged "
        "rows either way, and the collective is chosen per backend (on gloo, an all-reduce of the rank-major "
        "buffer, which is faster there)."
    ),
    "zero_optimization.allgather_partitions": NoOp(
        "false asks DeepSpeed for per-rank broadcasts instead of one all-gather; every rank ends with the same "
        "updated parameters either way."
    ),
    "zero_optimization.round_robin_gradients": NoOp(
        "Orders gradient copies to host memory under CPU offload on an accelerator, which is not supported yet "
        "(refused); on the CPU there are no copies to order."
    ),
    "zero_optimization.offload_optimizer.pin_memory": NoOp(
        "Page-locks host buffers for host<->accelerator copies; CPU and NVMe offload are accepted only when "
        "training on the CPU, where there are no such copies."
    ),
    "zero_optimization.offload_optimizer.fast_init": NoOp(
        "DeepSpeed's faster start of NVMe optimizer offload; here the first step always creates the state "
        "chunk by chunk and writes it out (never whole in memory), which is that fast start."
    ),
    "zero_optimization.offload_param.pin_memory": NoOp(
        "As offload_optimizer.pin_memory: parameter offload (CPU, or NVMe at stage 3) is accepted only when "
        "training on the CPU."
    ),
    # zero_optimization, stage 3: FSDP2 (zero/fsdp.py) fetches and frees per wrapped block
    "zero_optimization.stage3_prefetch_bucket_size": NoOp(
        "FSDP2 all-gathers one wrapped block at a time and overlaps the next block's all-gather by its own "
        "prefetch policy; how far ahead is not set in elements."
    ),
    "zero_optimization.stage3_param_persistence_threshold": NoOp(
        "FSDP2 shards every parameter of each wrapped block; small parameters are not kept whole."
    ),
    "zero_optimization.stage3_model_persistence_threshold": NoOp(
        "Caps what stage3_param_persistence_threshold keeps whole, which is nothing here."
    ),
    "zero_optimization.stage3_max_live_parameters": NoOp(
        "FSDP2 frees each block's gathered parameters after its forward and backward, so at most the current "
        "and the prefetched block are live."
    ),
    "zero_optimization.stage3_max_reuse_distance": NoOp(
        "Keeps a gathered parameter that is reused soon; FSDP2 re-gathers per block instead."
    ),
    # partly read: the stages where the key changes nothing
    "zero_optimization.overlap_comm": NoOp(
        "DDP (stage 0) and FSDP2 (stage 3) always overlap gradient reduction with the backward pass; "
        "stages 1/2 read it.", stages=(0, 3),
    ),
    "zero_optimization.reduce_bucket_size": NoOp(
        "FSDP2 reduce-scatters one block's gradients at a time; stages 0-2 read it.", stages=(3,),
    ),
    # compression_training (engine/config_compression.py)
    "compression_training.weight_quantization.shared_parameters.quantizer_kernel": NoOp(
        "Chose DeepSpeed's CUDA quantizer kernel; the torch quantizer here computes the same values."
    ),
    "compression_training.weight_quantization.shared_parameters.quantize_verbose": NoOp(
        "Makes DeepSpeed log each bit-width switch; training is the same, and no such log line exists here."
    ),
    "compression_training.sparse_pruning.shared_parameters.excluded_modules": NoOp(
        "Read by DeepSpeed only for snip_momentum pruning, which is refused; l1 and topk ignore it there too."
    ),
    "compression_training.sparse_pruning.shared_parameters.dense_ratio": NoOp(
        "Read by DeepSpeed only for snip_momentum pruning; l1 and topk use each group's dense_ratio."
    ),
    # optimizer section, the 1-bit optimizers (engine/config_onebit.py)
    "optimizer.params.cuda_aware": NoOp(
        "DeepSpeed's switch for CUDA-aware MPI in the 1-bit optimizers; their compressed all-reduce goes through "
        "engine/comm.py on the data-parallel group's own backend."
    ),
    "optimizer.params.comm_backend_name": NoOp(
        "Chose DeepSpeed's transport (nccl, mpi, hccl, compressed) for the 1-bit optimizers; the compressed "
        "all-reduce here runs on the data-parallel group's backend, whichever is named."
    ),
    # other sections
    "prescale_gradients": NoOp(
        "Moves DeepSpeed's division by the world size before the sum to keep fp16 sums in range; every strategy "
        "here reduces in fp32, where the order makes no difference."
    ),
    "gradient_predivide_factor": NoOp("As prescale_gradients: splits the same division in two around an fp32 sum."),
    # DeepSpeed keys that are not fields here, accepted at any value (config_keys.NOT_SUPPORTED)
    "vocabulary_size": NoOp("DeepSpeed only compares it with the embedding size and logs a warning."),
    "bf16.immediate_grad_update": NoOp(
        "When DeepSpeed's bf16 optimizer copies gradients into fp32; the step sees the same fp32 gradients."
    ),
    "zero_allow_untested_optimizer": NoOp(
        "DeepSpeed refuses unknown optimizers under ZeRO unless this is true; here every torch optimizer works "
        "at every stage, so nothing is refused."
    ),
}
