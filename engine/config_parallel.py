"""Which config key sets which parallelism degree, and the data-parallel size they leave: read by
`deepfleet.engine.parallel.ParallelDims.from_config` and, before torch is imported, by the batch
arithmetic of `engine.initialize` and `deepfleet validate`. Torch-free."""

from __future__ import annotations

from typing import Any

# degree -> dotted config key that sets it; data parallelism takes the rest of the world.
DEGREE_KEYS: dict[str, str] = {
    "ep": "moe.ep_size",
    "sp": "sequence_parallel_size",  # Ulysses sequence parallelism (engine/attention/)
    "pp": "pipeline.stages",  # engine/pipe/: PipelineModule(num_stages=...) fills it in
    "tp": "tensor_parallel.autotp_size",  # AutoTP training (engine/autotp.py); 0 means off
}
OFF_VALUES: dict[str, int] = {"tp": 0}
"""Degrees whose config key spells "off" with a value that is not a degree (DeepSpeed's autotp_size 0)."""


def raw_dp_size(source: Any, *, world_size: int) -> int | None:
    """The data-parallel size the raw config's degree keys (integers only) leave of `world_size` ranks, so
    a `train_batch_size` written for it resolves on the first parse; None when they cannot tell (the
    full parse then reports the degrees' problem by key). Expert parallelism is carved out of the
    data-parallel ranks, so it leaves their number as it is."""
    from deepfleet.engine.config_source import read_source

    raw = read_source(source, [])
    if raw is None:
        return None
    product = 1
    for degree, key in DEGREE_KEYS.items():
        value: Any = raw
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if degree == "ep" or not isinstance(value, int) or isinstance(value, bool) or value == OFF_VALUES.get(degree):
            continue
        if value < 1:
            return None
        product *= value
    return world_size // product if world_size % product == 0 else None
