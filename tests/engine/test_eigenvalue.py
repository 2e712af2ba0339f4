"""The `eigenvalue` section: power iteration gives each block's dominant Hessian eigenvalue (checked
against `torch.linalg.eigvalsh` on quadratics whose Hessians are known), DeepSpeed's
`compute_eigenvalue(module)` call after `backward(create_graph=True)`, and the engine's estimate at
accumulation boundaries that leaves training unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import deepfleet.engine as deepspeed
from deepfleet.engine.config import ConfigError, load_config
from deepfleet.engine.eigenvalue import Eigenvalue
from examples.gpt.model import GPTConfig, GPTWithLoss, SyntheticTokens
from tests.spawn import spawn

pytestmark = pytest.mark.usefixtures("one_rank_group")


class Quadratic(nn.Module):
    """loss = sum_i 0.5 x_i^T A_i x_i: block i's Hessian is A_i."""

    def __init__(self, hessians: list[torch.Tensor]) -> None:
        super().__init__()
        self.hessians = hessians
        self.layers = nn.ModuleList(nn.ParameterDict({"x": nn.Parameter(torch.randn(a.shape[0]))}) for a in hessians)

    def forward(self) -> torch.Tensor:
        return sum(0.5 * layer["x"] @ a @ layer["x"] for layer, a in zip(self.layers, self.hessians, strict=True))


def _symmetric(n: int, top: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    values = torch.linspace(0.1, 1.0, n, dtype=torch.float64) * top
    values[0] = -0.2 * top  # a negative eigenvalue smaller in magnitude than the dominant one
    return (q * values) @ q.T


# DeepSpeed's call needs backward(create_graph=True), which torch warns about (a grad/param cycle)
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_power_iteration_finds_each_blocks_dominant_eigenvalue() -> None:
    torch.manual_seed(0)
    hessians = [_symmetric(6, 4.0, 1).float(), _symmetric(6, 1.0, 2).float()]
    model = Quadratic(hessians)
    estimator = Eigenvalue(max_iter=200, tol=1e-6, layer_name="layers")
    result = estimator.block_eigenvalues(model(), model)
    truth = [float(torch.linalg.eigvalsh(a.double()).abs().max()) for a in hessians]
    assert estimator.last_raw == pytest.approx(truth, rel=1e-3)
    # DeepSpeed's shape: {block: [eigenvalue / the largest magnitude, block]}
    assert result == {0: [pytest.approx(1.0), 0], 1: [pytest.approx(truth[1] / truth[0], rel=1e-3), 1]}

    # the call DeepSpeed scripts make after their own backward(create_graph=True); the loss was scaled by 8
    (8.0 * model()).backward(create_graph=True)
    again = Eigenvalue(max_iter=200, tol=1e-6, layer_name="layers")
    again.compute_eigenvalue(model, scale=8.0)
    assert again.last_raw == pytest.approx(truth, rel=1e-3)
    with pytest.raises(ValueError, match="create_graph=True"):
        for p in model.parameters():
            p.grad = None
        model().backward()
        again.compute_eigenvalue(model)


def test_layer_name_and_layer_num_errors_name_the_key() -> None:
    model = Quadratic([torch.eye(2), torch.eye(2)])
    with pytest.raises(ValueError, match=r"eigenvalue.layer_name: the model has no submodule 'encoder.layer'"):
        Eigenvalue(layer_name="encoder.layer").blocks_of(model)
    with pytest.raises(ValueError, match=r"eigenvalue.layer_num: 3 blocks asked, the model has 2"):
        Eigenvalue(layer_name="layers", layer_num=3).blocks_of(model)
    assert len(Eigenvalue(layer_name="layers", layer_num=1).blocks_of(model)) == 1
    with pytest.raises(ConfigError, match="eigenvalue.enabled: .*stage 3"):
        load_config({"train_batch_size": 1, "zero_optimization": {"stage": 3}, "eigenvalue": {"enabled": True}})
    with pytest.raises(ConfigError, match="eigenvalue.max_iter"):
        load_config({"train_batch_size": 1, "eigenvalue": {"enabled": True, "max_iter": 0}})


TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)


def _train(stage: int, eigen: dict | None, steps: int = 3, offset: int = 0) -> tuple[list[float], list, object]:
    torch.manual_seed(0)
    model = GPTWithLoss(TINY)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    if eigen is not None:
        config["eigenvalue"] = eigen
    engine, *_ = deepspeed.initialize(model=model, config=config)
    records: list = []
    engine.sinks.append(records.append)
    data = SyntheticTokens(num_samples=32, seq_len=TINY.seq_len, vocab_size=TINY.vocab_size)
    losses = []
    for i in range(steps * 2):
        rows = [data[offset + 2 * i], data[offset + 2 * i + 1]]
        loss = engine({key: torch.stack([r[key] for r in rows]) for key in rows[0]})
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.destroy()
    return losses, records, engine


@pytest.mark.parametrize("stage", [0, 2])
def test_the_engine_estimates_at_boundaries_and_training_is_unchanged(stage: int) -> None:
    plain, _, _ = _train(stage, None)
    losses, records, engine = _train(stage, {"enabled": True, "max_iter": 20, "gas_boundary_resolution": 2})
    assert losses == pytest.approx(plain, abs=1e-6)
    # every second optimizer step: steps 2 (and not 1, 3) carry the estimates, one per GPT block
    assert [r.block_eigenvalues is not None for r in records] == [False, True, False]
    raw = records[1].block_eigenvalues
    assert len(raw) == TINY.n_layers and all(v == v and v != 0.0 for v in raw)
    assert sorted(engine.block_eigenvalue) == list(range(TINY.n_layers))
    assert max(abs(v) for v, _ in engine.block_eigenvalue.values()) == pytest.approx(1.0)


def _rank_estimates(rank: int, world_size: int) -> tuple[float, ...]:
    _, records, _ = _train(1, {"enabled": True, "max_iter": 20}, steps=1, offset=16 * rank)
    return records[0].block_eigenvalues


def test_the_estimates_are_averaged_over_the_data_parallel_group() -> None:
    # each rank estimates on its own micro-batch; both report the group's mean
    first, second = spawn(_rank_estimates, 2)
    assert first == second and len(first) == TINY.n_layers
