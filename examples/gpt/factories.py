"""Factories for the managed training loop: `entrypoint: {factory: "examples.gpt.factories:build"}`.

Called by `deepfleet.worker.train` in every training process (run the worker from the repository root so
`examples.gpt` imports). Returns the tiny GPT of `model.py` and its synthetic token data; the engine
config comes from the job spec (e.g. `examples/gpt/ds_config.json`).
"""

from __future__ import annotations

from deepfleet.worker.train import ManagedJob
from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens


def build(
    *,
    vocab_size: int = 512,
    seq_len: int = 64,
    d_model: int = 128,
    n_heads: int = 4,
    n_layers: int = 2,
    num_samples: int = 4096,
    seed: int = 0,
) -> ManagedJob:
    """The GPT job; keyword arguments come from `entrypoint.kwargs` and size the model and data."""
    import torch

    torch.manual_seed(seed)  # identical initial weights on every rank and every restart
    cfg = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, n_heads=n_heads, n_layers=n_layers)
    data = SyntheticTokens(num_samples=num_samples, seq_len=seq_len, vocab_size=vocab_size, seed=seed)
    return ManagedJob(model=GPTWithLoss(cfg), training_data=data)


def build_moe(
    *,
    vocab_size: int = 512,
    seq_len: int = 64,
    d_model: int = 128,
    n_heads: int = 4,
    n_layers: int = 2,
    num_samples: int = 4096,
    seed: int = 0,
) -> ManagedJob:
    """The MoE GPT job (`examples/gpt/moe_model.py`): its experts, top-k, capacity and ep_size come from
    the job's engine config `moe` section (`examples/gpt/moe_job.yaml`); defaults when it has none."""
    import torch

    from deepfleet.engine.moe.section import job_moe_section, layer_kwargs, model_kwargs
    from examples.gpt.moe_model import MoEArgs, MoEGPTWithLoss

    torch.manual_seed(seed)
    section = job_moe_section()
    moe = MoEArgs(**layer_kwargs(section), **model_kwargs(section)) if section is not None else MoEArgs()
    cfg = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, n_heads=n_heads, n_layers=n_layers)
    data = SyntheticTokens(num_samples=num_samples, seq_len=seq_len, vocab_size=vocab_size, seed=seed)
    return ManagedJob(model=MoEGPTWithLoss(cfg, moe), training_data=data)
