"""What a deepfleet job hands a training script through the environment, read on the engine's side.

The worker (`deepfleet.worker.agent.child_environment`) sets these in every training process of a job;
a script run by plain torchrun has none of them, and nothing here then applies. Called by
`deepfleet.engine.initialize` (the engine config when the script passes none) and by scripts:

    steps = job_env.max_steps() or args.steps          # the job's step budget (spec.maxSteps)
    ckpt = job_env.checkpoint_dir() or args.ckpt       # the job's checkpoint directory

Torch-free; the names are the contract, the worker's side imports them from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENGINE_CONFIG_ENV = "DEEPFLEET_ENGINE_CONFIG"  # JSON text of an inline config, or a .json/.yaml path
CHECKPOINT_DIR_ENV = "DEEPFLEET_CHECKPOINT_DIR"
CHECKPOINT_EVERY_ENV = "DEEPFLEET_CHECKPOINT_EVERY_STEPS"
MAX_STEPS_ENV = "DEEPFLEET_MAX_STEPS"


def engine_config(environ: Mapping[str, str] | None = None) -> str | None:
    """The job's engine config source (what `load_config` reads), or None outside a job / when unset."""
    return (os.environ if environ is None else environ).get(ENGINE_CONFIG_ENV) or None


def checkpoint_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The job's checkpoint directory (`spec.checkpoint.dir`), or None."""
    return (os.environ if environ is None else environ).get(CHECKPOINT_DIR_ENV) or None


def checkpoint_every_steps(environ: Mapping[str, str] | None = None) -> int | None:
    """How often the job asks for a checkpoint (`spec.checkpoint.everySteps`), or None."""
    return _int(CHECKPOINT_EVERY_ENV, environ)


def max_steps(environ: Mapping[str, str] | None = None) -> int | None:
    """The job's step budget (`spec.maxSteps`), or None."""
    return _int(MAX_STEPS_ENV, environ)


def _int(name: str, environ: Mapping[str, str] | None) -> int | None:
    raw = (os.environ if environ is None else environ).get(name)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; the worker sets it from the job spec") from None
