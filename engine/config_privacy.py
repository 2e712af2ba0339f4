"""The `deepfleet_differential_privacy` section: DP-SGD training (engine/privacy.py).

deepfleet's own section (DeepSpeed has no differential-privacy key). Torch-free.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from deepfleet.engine.config_base import Bool, ConfigSection, Float, Int


class DifferentialPrivacyConfig(ConfigSection):
    """DP-SGD: per-sample gradient clipping to `max_grad_norm` and one Gaussian noise draw of standard
    deviation `noise_multiplier * max_grad_norm` per optimizer step over all ranks, with a privacy
    accountant reporting epsilon at `delta`."""

    enabled: Bool = False
    """Train with DP-SGD."""
    noise_multiplier: Float | None = Field(None, ge=0.0)
    """Noise standard deviation as a multiple of `max_grad_norm`; set it or `target_epsilon`."""
    target_epsilon: Float | None = Field(None, gt=0.0)
    """Epsilon to reach after `epochs` epochs: the noise multiplier is derived from it by the accountant."""
    epochs: Float | None = Field(None, gt=0.0)
    """Epochs of training that `target_epsilon` budgets for."""
    max_grad_norm: Float = Field(1.0, gt=0.0)
    """Per-sample gradient clip norm C (over all parameters of one sample)."""
    delta: Float = Field(1e-5, gt=0.0, lt=1.0)
    """Delta of the (epsilon, delta) guarantee reported."""
    sample_rate: Float | None = Field(None, gt=0.0, le=1.0)
    """Probability that one example is in a step's batch; unset = train_batch_size / dataset_size."""
    dataset_size: Int | None = Field(None, gt=0)
    """Examples in the training set, for `sample_rate`; unset = the length of `training_data`."""
    accountant: Literal["rdp", "prv"] = "rdp"
    """Privacy accountant (Opacus'): Renyi DP or privacy random variables."""
    secure_rng: Bool = False
    """Seed each step's noise generator from `os.urandom` (rank 0's, broadcast so the draw stays single)
    instead of `seed`; runs are then not reproducible. The generator is still torch's Mersenne Twister,
    not a cryptographically secure one."""
    seed: Int = Field(0, ge=0)
    """Seed of the noise generator, the same on every rank (step k draws from seed + k)."""

    @model_validator(mode="after")
    def _noise_source(self) -> DifferentialPrivacyConfig:
        if not self.enabled:
            return self
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("noise_multiplier: unset; set noise_multiplier "
                             "or target_epsilon with epochs")
        if self.noise_multiplier is not None and self.target_epsilon is not None:
            raise ValueError("target_epsilon: set together with noise_multiplier; "
                             "set only one of them")
        if self.target_epsilon is not None and self.epochs is None:
            raise ValueError("epochs: unset with target_epsilon; set the epochs it budgets for")
        return self
