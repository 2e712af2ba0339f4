"""Resume at any world size and ZeRO stage through the real engine (engine.save_checkpoint /
engine.load_checkpoint): train k steps at world size 2 stage 3, save, resume elsewhere; the next steps'
losses equal an uninterrupted run, data order and RNG included."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.spawn import spawn

# Each case trains two short runs on 1-3 gloo ranks: ~20-40 s apiece on a shared 2-core box.
pytestmark = pytest.mark.slow

K, N = 3, 3  # steps before the save, steps compared after it
GLOBAL_BATCH = 12  # micro-batch 12 / 6 / 4 at world size 1 / 2 / 3
SAMPLES = 48  # 4 steps per epoch: the compared steps cross an epoch boundary


def _config(stage: int) -> dict:
    return {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 4}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
        "seed": 7,
    }


def _engine(stage: int, dropout: float, *, own_loader_rng: bool = True, d_model: int = 32):
    import deepfleet.engine as deepfleet
    from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=d_model, n_heads=2, n_layers=2, dropout=dropout)
    torch.manual_seed(0)
    model = GPTWithLoss(cfg)
    data = SyntheticTokens(num_samples=SAMPLES, seq_len=16, vocab_size=64, seed=3)
    engine, _, loader, _ = deepfleet.initialize(model=model, config=_config(stage), training_data=data)
    if own_loader_rng:
        # Every torch DataLoader iterator draws a base seed from the *global* RNG unless the loader has
        # its own generator; a resumed loop opens one iterator more than the uninterrupted loop, which
        # would shift the dropout stream. engine/dataloader.py does not give it one yet (see the xfail).
        loader.generator = torch.Generator().manual_seed(5)
    return engine, loader


class _Batches:
    """Endless micro-batches from the engine's loader, one epoch per pass (as a user's loop would)."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.it = iter(loader)

    def next(self):
        while True:
            try:
                return next(self.it)
            except StopIteration:
                self.it = iter(self.loader)


def _steps(engine, batches: _Batches, n: int) -> list[float]:
    """n optimizer steps; the global mean loss of each (every rank's micro-batch has the same size)."""
    import torch.distributed as dist

    losses = []
    for _ in range(n):
        loss = engine(batches.next())
        engine.backward(loss)
        engine.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def _uninterrupted(
    rank: int, world: int, root: str, stage: int, dropout: float, own_rng: bool = True, async_save: bool = False
) -> list[float]:
    engine, loader = _engine(stage, dropout, own_loader_rng=own_rng)
    batches = _Batches(loader)
    _steps(engine, batches, K)
    engine.save_checkpoint(root, client_state={"note": "after k steps", "k": K}, async_save=async_save)
    # With async_save these steps run while the shards are written; the checkpoint must not see them.
    losses = _steps(engine, batches, N)
    engine.load_checkpoint(root)  # waits for the async save and leaves the engine at step K
    assert engine.global_steps == K
    return losses


def _resumed(rank: int, world: int, root: str, stage: int, dropout: float, own_rng: bool = True) -> dict:
    engine, loader = _engine(stage, dropout, own_loader_rng=own_rng)
    path, client_state = engine.load_checkpoint(root)
    losses = _steps(engine, _Batches(loader), N)
    return {"path": path, "client_state": client_state, "steps": engine.global_steps, "losses": losses}


@pytest.fixture(scope="module")
def with_dropout(tmp_path_factory) -> tuple[str, list[float]]:
    root = str(tmp_path_factory.mktemp("dropout"))
    return root, spawn(_uninterrupted, 2, root, 3, 0.1)[0]


@pytest.fixture(scope="module")
def without_dropout(tmp_path_factory) -> tuple[str, list[float]]:
    root = str(tmp_path_factory.mktemp("nodropout"))
    return root, spawn(_uninterrupted, 2, root, 3, 0.0)[0]


@pytest.mark.parametrize("stage", [3, 0, 2])
def test_resume_same_world_size_continues_data_and_rng(with_dropout, stage: int) -> None:
    root, expected = with_dropout
    result = spawn(_resumed, 2, root, stage, 0.1)[0]
    assert result["path"] == str(Path(root) / f"global_step{K}")
    assert result["client_state"] == {"note": "after k steps", "k": K}
    assert result["steps"] == K + N
    assert result["losses"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("world,stage", [(1, 0), (3, 2), (3, 3), (1, 2)])
def test_resume_at_other_world_size_and_stage(without_dropout, world: int, stage: int) -> None:
    root, expected = without_dropout
    assert spawn(_resumed, world, root, stage, 0.0)[0]["losses"] == pytest.approx(expected, rel=1e-5)


def test_nothing_to_load_returns_none(tmp_path: Path) -> None:
    assert spawn(_load_nothing, 1, str(tmp_path))[0] == [None, None]


def _load_nothing(rank: int, world: int, root: str) -> list:
    engine, _ = _engine(0, 0.0)
    return list(engine.load_checkpoint(root))


def test_async_save_equals_sync_save(with_dropout, tmp_path: Path) -> None:
    root, expected = with_dropout
    assert spawn(_uninterrupted, 2, str(tmp_path), 3, 0.1, True, True)[0] == expected
    sync_step, async_step = Path(root) / f"global_step{K}", tmp_path / f"global_step{K}"
    for name in ("__0_0.distcp", "__1_0.distcp"):
        assert (sync_step / name).read_bytes() == (async_step / name).read_bytes()
    assert spawn(_resumed, 2, str(tmp_path), 2, 0.1)[0]["losses"] == pytest.approx(expected, rel=1e-5)


def test_resume_with_the_engines_own_loader_keeps_rng(tmp_path: Path) -> None:
    expected = spawn(_uninterrupted, 2, str(tmp_path), 3, 0.1, False)[0]
    assert spawn(_resumed, 2, str(tmp_path), 3, 0.1, False)[0]["losses"] == pytest.approx(expected, rel=1e-5)


def _save_with_accumulation(rank: int, world: int, root: str) -> int:
    engine = _accumulating_engine()
    batches = _Batches(engine.training_dataloader)
    for _ in range(3 * engine.gradient_accumulation_steps()):  # three optimizer steps (6 micro-steps)
        engine.backward(engine(batches.next()))
        engine.step()
    engine.save_checkpoint(root)
    return engine.gradient_accumulation_steps()


def _load_with_accumulation(rank: int, world: int, root: str) -> dict:
    engine = _accumulating_engine()
    engine.load_checkpoint(root)
    gas = engine.gradient_accumulation_steps()
    boundaries = []
    batches = _Batches(engine.training_dataloader)
    for _ in range(gas):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.backward(engine(batches.next()))
        engine.step()
    return {"gas": gas, "global_steps": engine.global_steps, "boundaries": boundaries}


def _accumulating_engine():
    import deepfleet.engine as deepfleet
    from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens

    torch.manual_seed(0)
    model = GPTWithLoss(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=1))
    data = SyntheticTokens(num_samples=SAMPLES, seq_len=16, vocab_size=64, seed=3)
    # Fixed global batch and micro-batch: the accumulation count follows the world size (2 at ws 2, 4 at ws 1).
    config = {**_config(2), "gradient_accumulation_steps": None, "train_micro_batch_size_per_gpu": 3}
    config = {k: v for k, v in config.items() if v is not None}
    engine, _, _, _ = deepfleet.initialize(model=model, config=config, training_data=data)
    return engine


def test_resume_at_another_accumulation_count_starts_a_full_window(tmp_path: Path) -> None:
    """Saved at world size 2 (2 micro-steps per step), resumed at world size 1 (4 per step): the first
    optimizer step after the load accumulates a whole window, not the saved run's count."""
    assert spawn(_save_with_accumulation, 2, str(tmp_path)) == [2, 2]
    (after,) = spawn(_load_with_accumulation, 1, str(tmp_path))
    assert after == {"gas": 4, "global_steps": 4, "boundaries": [False, False, False, True]}
