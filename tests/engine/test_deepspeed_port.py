"""A training script written for DeepSpeed runs on deepfleet with only the import changed: it builds the
engine from a DeepSpeed JSON config, trains with engine(batch)/backward/step on the returned data
loader, logs, checkpoints with `save_checkpoint`, and resumes with `load_checkpoint`, on 2 ranks."""

from __future__ import annotations

import json

import pytest
import torch

from tests.spawn import spawn

DS_CONFIG = {
    "train_batch_size": 8,
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3, "total_num_steps": 40}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                          "reduce_bucket_size": 50000, "allgather_bucket_size": 50000},
    "bf16": {"enabled": True},
    "steps_per_print": 4,
    "wall_clock_breakdown": False,
}


def deepspeed_script(rank: int, world_size: int, ckpt_dir: str, config_path: str) -> dict:
    """What a DeepSpeed user writes (the only change is the first import line)."""
    import deepfleet.engine as deepspeed
    from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_layers=2))
    dataset = SyntheticTokens(num_samples=160, seq_len=32, vocab_size=128)
    engine, optimizer, dataloader, lr_scheduler = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config_path, training_data=dataset
    )
    losses = []
    for batch in dataloader:  # one epoch: 160 / (2 ranks * 2) = 40 micro-steps = 20 optimizer steps
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(ckpt_dir, client_state={"epoch": 1})

    # resume in a fresh engine, as a restarted job would
    torch.manual_seed(1)
    fresh = GPTWithLoss(GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_heads=4, n_layers=2))
    engine2, _, _, lr_scheduler2 = deepspeed.initialize(
        model=fresh, model_parameters=fresh.parameters(), config=config_path, training_data=dataset
    )
    path, client_state = engine2.load_checkpoint(ckpt_dir)
    same = all(torch.equal(a.detach(), b.detach()) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    return {
        "first": sum(losses[:8]) / 8,
        "last": sum(losses[-8:]) / 8,
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "lr": engine.get_lr()[0],
        "grad_norm": engine.get_global_grad_norm(),
        "resumed": (path is not None, client_state, engine2.global_steps, same, lr_scheduler2.get_last_lr()[0]),
    }


@pytest.mark.slow
def test_deepspeed_script_trains_checkpoints_and_resumes_on_two_ranks(tmp_path) -> None:
    config_path = tmp_path / "ds_config.json"
    config_path.write_text(json.dumps(DS_CONFIG))
    results = spawn(deepspeed_script, 2, str(tmp_path / "ckpt"), str(config_path), timeout=240)
    for r in results:
        assert r["global_steps"] == 20 and r["micro_steps"] == 40
        assert r["last"] < r["first"] - 0.3, (r["first"], r["last"])  # it learns
        assert 0 < r["lr"] < 3e-3  # warmed up, now decaying
        assert r["grad_norm"] is not None and r["grad_norm"] > 0
        found, client_state, steps, same, lr = r["resumed"]
        assert found and client_state == {"epoch": 1} and steps == 20 and same
        assert lr == r["lr"]
