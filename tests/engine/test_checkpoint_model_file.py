"""`engine.save_16bit_model` (DeepSpeed's HF save path) at 2 gloo ranks: the same plain bf16 state dict
at stages 0, 2 and 3 (stage 3 gathers it only with stage3_gather_16bit_weights_on_model_save, else
returns False and writes nothing, as DeepSpeed does), loadable without deepfleet, holding the current
weights after a step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.spawn import spawn

VOCAB = 64


def _engine(*, stage: int, bf16: bool, gather: bool):
    import deepfleet.engine as deepfleet
    from examples.gpt.model import GPTConfig, GPTWithLoss

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=16, d_model=32, n_heads=2, n_layers=2)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": gather},
    }
    engine, *_ = deepfleet.initialize(model=GPTWithLoss(cfg), config=config)
    return engine


def _saves(rank: int, world: int, root: str) -> dict:
    from torch.distributed.tensor import DTensor

    out: dict = {}
    for stage in (0, 2, 3):
        engine = _engine(stage=stage, bf16=True, gather=True)
        out[f"bf16-{stage}"] = engine.save_16bit_model(f"{root}/bf16-{stage}")
    # stage 3 without the gather flag: nothing written (the flag is read at call time)
    engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save = False
    out["no-gather"] = engine.save_16bit_model(f"{root}/no-gather")
    engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save = True
    # after one step the file holds the updated weights (compared on rank 0)
    torch.manual_seed(1)
    idx = torch.randint(0, VOCAB, (2, 17))
    engine.backward(engine({"input_ids": idx[:, :-1], "labels": idx[:, 1:]}))
    engine.step()
    out["stepped"] = engine.save_16bit_model(root, "stepped.bin")
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to(torch.bfloat16)
            for n, p in engine.module.named_parameters()}
    if rank == 0:
        saved = torch.load(f"{root}/stepped.bin", weights_only=True)
        out["stepped-matches"] = all(torch.equal(saved[n], t) for n, t in full.items())
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    out["consolidated-on-rank"] = consolidated is not None
    return out


@pytest.mark.slow
def test_save_16bit_model_writes_the_same_plain_state_dict_at_every_stage(tmp_path: Path) -> None:
    from examples.gpt.model import GPTConfig, GPTWithLoss

    results = spawn(_saves, 2, str(tmp_path))
    for r in results:
        assert r["bf16-0"] and r["bf16-2"] and r["bf16-3"] and r["stepped"]
        assert r["no-gather"] is False
    assert results[0]["stepped-matches"] is True
    assert [r["consolidated-on-rank"] for r in results] == [True, False]
    assert not (tmp_path / "no-gather").exists()

    files = {s: torch.load(tmp_path / f"bf16-{s}" / "pytorch_model.bin", weights_only=True) for s in (0, 2, 3)}
    assert files[0].keys() == files[2].keys() == files[3].keys()
    for name, t in files[0].items():
        assert t.device.type == "cpu"
        assert t.dtype == (torch.bfloat16 if t.is_floating_point() else t.dtype), name
        assert torch.equal(t, files[2][name]) and torch.equal(t, files[3][name]), name
    # loads into a plain model, no deepfleet involved
    model = GPTWithLoss(GPTConfig(vocab_size=VOCAB, seq_len=16, d_model=32, n_heads=2, n_layers=2)).to(torch.bfloat16)
    model.load_state_dict(files[3])
