"""init_inference(checkpoint=...): a deepfleet checkpoint saved at world size 2 / ZeRO-3 by the real
engine gives the trained model's logits (loaded in one process), and a safetensors file loads too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepfleet.engine import init_inference
from deepfleet.engine.checkpoint.export import export_safetensors
from tests.spawn import spawn

# Two gloo ranks train and save through the real engine: ~40 s on a shared 2-core box.
pytestmark = pytest.mark.slow

IDS = torch.tensor([[3, 9, 27, 17, 8, 40, 1, 5], [60, 2, 2, 7, 33, 12, 30, 4]])


def _cfg():
    from examples.gpt.model import GPTConfig

    return GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)


def _train_zero3_and_save(rank: int, world: int, root: str) -> torch.Tensor | None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import deepfleet.engine as deepfleet
    from examples.gpt.model import GPTWithLoss, SyntheticTokens

    torch.manual_seed(0)
    config = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3}, "seed": 7}
    data = SyntheticTokens(num_samples=32, seq_len=16, vocab_size=64, seed=3)
    engine, _, loader, _ = deepfleet.initialize(model=GPTWithLoss(_cfg()), config=config, training_data=data)
    for batch, _ in zip(loader, range(3), strict=False):
        engine.backward(engine(batch))
        engine.step()
    engine.save_checkpoint(root)
    full = get_model_state_dict(engine.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    trained = GPTWithLoss(_cfg())
    trained.load_state_dict(full)
    with torch.no_grad():
        return trained.gpt(IDS)


@pytest.fixture(scope="module")
def zero3_checkpoint(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("zero3")
    return root, spawn(_train_zero3_and_save, 2, str(root))[0]


def test_zero3_world_size_2_checkpoint_gives_the_trained_logits(zero3_checkpoint):
    from examples.gpt.model import GPTWithLoss, TinyGPT

    root, trained_logits = zero3_checkpoint
    torch.manual_seed(123)  # a fresh, differently initialized model: every weight must come from the file
    for model in (GPTWithLoss(_cfg()), TinyGPT(_cfg())):  # the saved module, or the one inside it
        engine = init_inference(model, dtype=torch.float32, checkpoint=str(root), max_out_tokens=16)
        torch.testing.assert_close(engine(IDS), trained_logits, atol=1e-5, rtol=1e-5)
    step = init_inference(TinyGPT(_cfg()), dtype=torch.float32, checkpoint=str(root / "global_step3"))
    torch.testing.assert_close(step(IDS), trained_logits, atol=1e-5, rtol=1e-5)


def test_safetensors_file_loads(zero3_checkpoint, tmp_path):
    from examples.gpt.model import GPTWithLoss

    root, trained_logits = zero3_checkpoint
    export_safetensors(root / "global_step3", tmp_path / "m.safetensors")
    engine = init_inference(GPTWithLoss(_cfg()), dtype=torch.float32, checkpoint=str(tmp_path / "m.safetensors"))
    torch.testing.assert_close(engine(IDS), trained_logits, atol=1e-5, rtol=1e-5)


def test_a_checkpoint_that_does_not_fit_names_the_tensor(zero3_checkpoint, tmp_path):
    from examples.gpt.model import GPTConfig, TinyGPT

    root, _ = zero3_checkpoint
    wider = TinyGPT(GPTConfig(vocab_size=64, seq_len=16, d_model=48, n_heads=2, n_layers=2))
    with pytest.raises(ValueError, match=r"checkpoint: does not fit the model: .*tok\.weight has shape"):
        init_inference(wider, checkpoint=str(root))
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        init_inference(wider, checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="no such file"):
        init_inference(wider, checkpoint=str(tmp_path / "missing.safetensors"))
