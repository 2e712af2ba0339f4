"""`deepspeed.elasticity`'s path under deepfleet: `compute_elastic_config` and its error, whose arithmetic is
`deepfleet.engine.config_batch_elasticity` (where `load_config` applies it, torch-free)."""

from deepfleet.engine.config_batch_elasticity import (  # noqa: F401 - DeepSpeed's path
    ElasticityError,
    compute_elastic_config,
)
